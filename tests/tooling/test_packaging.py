"""Distribution: build facts, the torch version guard, metadata, the sdist's contents, typing.

`make test-package` runs this file again from an unpacked sdist, against a
wheel built from it and installed into a fresh venv.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import pytest
import torch

import relu_ext
from relu_ext import _build, _C

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(relu_ext.__file__).parent


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def test_build_info_is_consistent():
    info = relu_ext.build_info()
    assert info["cpu_isa"] in ("avx512", "avx2", "scalar") and info["torch"] == torch.__version__
    assert info["cuda"] == _C.with_cuda  # compiled in; cuda_available() also needs a GPU
    assert relu_ext.cuda_available() == (_C.with_cuda and torch.cuda.is_available())
    assert _major_minor(info["built_with_torch"]) == _major_minor(torch.__version__)
    if info["cuda"]:
        assert info["cpu_only_reason"] is None and info["cuda_arch_list"] and info["cuda_arch_source"]
    else:
        assert info["cpu_only_reason"] and info["cuda_arch_list"] is None
    if os.environ.get("RELU_EXT_FORCE_CPU") == "1":
        assert "RELU_EXT_FORCE_CPU" in info["cpu_only_reason"]


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else None


@pytest.mark.skipif(not str(relu_ext.build_info()["cuda_arch_source"]).startswith("default"),
                    reason="this build's CUDA arch list was not the no-GPU default")
def test_default_arch_list_covers_common_gpus():
    archs = relu_ext.build_info()["cuda_arch_list"].split(";")
    assert archs[-1].endswith("+PTX")
    plain = [a.removesuffix("+PTX") for a in archs]
    assert {"8.0", "8.6", "8.9", "9.0"} <= set(plain), archs  # A100, RTX 30xx/A10, L4/RTX 40xx, H100
    if _nvcc():
        out = subprocess.run([_nvcc(), "--list-gpu-code"], capture_output=True, text=True, check=True).stdout
        assert all(f"sm_{a.replace('.', '')}" in out for a in plain), (archs, out)


@pytest.mark.skipif(not str(relu_ext.build_info()["cuda_arch_source"]).startswith("development"),
                    reason="this build was not a development build with no GPU visible")
def test_development_build_compiles_one_architecture():
    """pip install -e . (and build_ext --inplace) with no GPU visible: sm_90 alone, which
    test_cuda_codegen reads; wheels keep the list above."""
    assert relu_ext.build_info()["cuda_arch_list"] == "9.0"


def test_other_torch_minor_is_refused_by_name():
    with pytest.raises(ImportError, match=r"built against torch 2\.14\.1.*torch 2\.15\.0 is installed.*no-build-isolation"):
        _build.check_torch(running="2.15.0", built="2.14.1")
    with pytest.raises(ImportError, match=r"torch 3\.14\.0"):
        _build.check_torch(running="3.14.0", built="2.14.1+cu130")
    _build.check_torch(running="2.14.2", built="2.14.1+cu130")  # patch releases keep the ABI
    _build.check_torch(running="2.14.0a0+git1234", built="2.14.1")


def _python(code: str) -> str:
    """stdout of `code` run in a fresh interpreter (a fresh import of relu_ext), which must exit 0."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_under_another_torch_fails_before_the_native_module_loads():
    code = (
        "import sys, torch\n"
        "torch.__version__ = '1.99.0'\n"
        "try:\n"
        "    import relu_ext\n"
        "except ImportError as e:\n"
        "    print('REFUSED', e)\n"
        "print('LOADED' if 'relu_ext._C' in sys.modules else 'NOT LOADED')\n"
    )
    out = _python(code)
    assert "REFUSED relu_ext was built against torch" in out and "1.99.0" in out, out
    assert "NOT LOADED" in out, out


def test_gpu_unused_warning_names_the_reason(monkeypatch):
    monkeypatch.setattr(_build._config, "CPU_ONLY_REASON", "nvcc was not found (set CUDA_HOME to a CUDA toolkit)")
    with pytest.warns(RuntimeWarning, match=r"torch sees a GPU.*CPU kernels only \(nvcc was not found"):
        _build.warn_if_gpu_unused(with_cuda=False, gpu_visible=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _build.warn_if_gpu_unused(with_cuda=True, gpu_visible=True)
        _build.warn_if_gpu_unused(with_cuda=False, gpu_visible=False)


def test_import_warns_only_when_a_gpu_goes_unused():
    """The check at import: a CPU-only build warns where torch sees a GPU (simulated here)."""
    code = (
        "import warnings, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import relu_ext\n"
        "print(sum('torch sees a GPU' in str(x.message) for x in w))\n"
    )
    out = _python(code)
    assert out.split()[-1] == ("0" if relu_ext.build_info()["cuda"] else "1"), out


def test_stub_declares_the_native_module():
    stub = PACKAGE / "_C.pyi"
    assert (PACKAGE / "py.typed").exists() and stub.exists()
    tree = ast.parse(stub.read_text())
    declared = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign):
            declared.add(node.target.id)
    public = {name for name in dir(_C) if not name.startswith("__")}
    nodes = {node for _, node, _ in _C.activation_table()}  # the stub's __getattr__ types them as _MaskBackward
    assert declared - {"_MaskBackward", "__getattr__"} == public - nodes and nodes <= public


def test_metadata():
    try:
        meta = importlib.metadata.metadata("relu_ext")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("relu_ext is imported from a build tree, with no installed metadata")
    assert meta["Version"] == relu_ext.__version__
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta["Author"] or meta["Author-email"]
    assert meta.get_all("Classifier") and meta["Keywords"]
    # The pin is the torch major.minor the installed copy was compiled against.
    requires = meta.get_all("Requires-Dist") or []
    torch_req = [r for r in requires if re.match(r"torch\b", r)]
    assert torch_req == [f"torch=={_major_minor(relu_ext.build_info()['built_with_torch'])}.*"], requires


@pytest.mark.skipif(not (ROOT / "setup.py").exists(), reason="not run from a source tree")
def test_sdist_holds_what_a_build_needs(tmp_path):
    """Every tracked file but the benchmark's results: CI builds the release wheel in the tree (to
    reuse the development build's objects), which is then the sdist's build only while a fresh
    clone holds nothing a build could read that the sdist lacks."""
    subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist", "-d", str(tmp_path)],
        cwd=ROOT, check=True, capture_output=True, timeout=600,
    )
    (sdist,) = tmp_path.glob("relu_ext-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    needed = {"setup.py", "pyproject.toml", "MANIFEST.in", "LICENSE", "README.md", "CHANGELOG.md", "CONTRIBUTING.md",
              "Makefile",
              "csrc/core/bits.h", "csrc/core/checks.h", "csrc/activations/cuda.cu", "tests/conftest.py", "tests/cases.py",
              "src/relu_ext/py.typed", "src/relu_ext/_C.pyi", "examples/two_layer_net.py"}
    needed |= {f for f in tracked if not f.startswith("bench/results/") and f != ".gitignore"}
    assert needed <= names, sorted(needed - names)
    assert not {n for n in names if n.endswith(".so") or n.endswith("_build_config.py")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF and /proc/self/maps")
def test_one_libstdcxx_in_the_process():
    """_C.so needs the shared libstdc++ torch uses, not a static copy of its own: with
    two copies (a GPU image's compiler had no shared one) the first error message
    that formatted an integer crashed the process."""
    with open("/proc/self/maps") as f:
        copies = {line.split()[-1] for line in f if "/libstdc++.so" in line}
    assert len(copies) == 1, copies
    readelf = subprocess.run(["readelf", "-d", _C.__file__], capture_output=True, text=True)
    if readelf.returncode != 0:
        pytest.skip("readelf is not available")
    assert "Shared library: [libstdc++.so.6]" in readelf.stdout, readelf.stdout
    with pytest.raises(RuntimeError, match=r"mask has shape \[12\] but grad has 100 elements"):
        torch.ops.relu_ext.relu_bwd(torch.randn(100), torch.zeros(12, dtype=torch.uint8))


@pytest.mark.skipif(not (ROOT / "setup.py").exists() or not sys.platform.startswith("linux"),
                    reason="not run from a Linux source tree")
@pytest.mark.full  # two setup.py processes (~10 s)
def test_setup_links_torchs_libstdcxx_for_a_compiler_without_one(tmp_path):
    """A compiler whose -print-file-name=libstdc++.so finds no shared library gets the
    libstdc++ torch runs with on its link line; a normal compiler gets nothing added."""
    fake = tmp_path / "g++"
    fake.write_text('#!/bin/sh\ncase "$1" in -print-file-name=*) echo "${1#-print-file-name=}";; esac\n')
    fake.chmod(0o755)

    def name_with(**env: str) -> str:
        run = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300, env={**os.environ, **env})
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout

    out = name_with(CXX=str(fake), CC=str(fake))
    linked = re.search(r"relu_ext: \S+ has no shared libstdc\+\+; linking (\S+) \(torch's\)", out)
    assert linked and "libstdc++.so" in linked.group(1) and os.path.exists(linked.group(1)), out
    assert "has no shared libstdc++" not in name_with(CXX="c++", CC="c++")


def test_version_is_written_once():
    """pyproject.toml reads the version from relu_ext.__version__ instead of repeating it."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    assert re.fullmatch(r"\d+\.\d+\.\d+", relu_ext.__version__)
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not run from a source tree")
    config = tomllib.loads(pyproject.read_text())
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "relu_ext.__version__"}


def test_classifiers_match_requires_python():
    """The Python classifiers run from requires-python's floor to the newest listed, and
    every Python source of the package and its tests parses as that floor's syntax (CI
    runs 3.11 only: this is what it can check of the others)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not run from a source tree")
    project = tomllib.loads(pyproject.read_text())["project"]
    floor = tuple(int(p) for p in re.fullmatch(r">=(\d+)\.(\d+)", project["requires-python"]).groups())
    listed = sorted(tuple(int(p) for p in c.rsplit(" ", 1)[1].split("."))
                    for c in project["classifiers"] if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c))
    assert listed[0] == floor and listed == [(3, m) for m in range(floor[1], listed[-1][1] + 1)], listed
    assert (3, sys.version_info.minor) in listed
    import ast

    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]:
        ast.parse(path.read_text(), filename=str(path), feature_version=floor)
