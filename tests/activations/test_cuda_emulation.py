"""The CUDA device code, run on the CPU by tests/activations/cuda_emulation.cpp (one
fiber per lane, ballots and shuffles across the 32 lanes of a warp): every kernel, dtype,
vector width and unroll against the element-wise contract, at every row,
group and mask-word edge and past several grid-stride passes, with guards
around every output and AddressSanitizer on every input. It needs no GPU, so
CI checks the kernels' logic; tests/activations/test_cuda.py checks them on a GPU.

The family's cases are tests/cases.py's rows (every op but relu, whose kernels the harness
checks on their own), passed on its command line as `label op a b`: the harness dispatches
the op by name over RELU_EXT_FAMILY and builds the trait's CUDA Params from c10::Scalar, so a
new activation or row needs no line in it. It names each case it ran, and those must be the
table's family rows, each once."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
from cases import CASES
from conftest import tool_env
from torch.utils import cpp_extension

# Compiling the harness and its 39 million checks take minutes: the full tier's.
pytestmark = pytest.mark.full

HARNESS = Path(__file__).with_name("cuda_emulation.cpp")
CSRC = next(p / "csrc" for p in Path(__file__).resolve().parents if (p / "csrc").is_dir())  # the kernels' includes
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def _cxx() -> str:
    return os.environ.get("CXX") or shutil.which("c++") or "g++"


def _compile(out: Path, extra: list[str]) -> subprocess.CompletedProcess:
    includes = [f"-I{CSRC}"] + [f"-I{p}" for p in cpp_extension.include_paths()]
    # c10 for c10::Scalar::to (the traits' params), found at run time through the rpath.
    libs = [a for p in cpp_extension.library_paths() for a in (f"-L{p}", f"-Wl,-rpath,{p}")] + ["-lc10"]
    cmd = [_cxx(), "-std=c++20", "-O1", "-g0", "-fno-strict-aliasing", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas", *extra,
           *includes, str(HARNESS), "-o", str(out), *libs]
    return subprocess.run(cmd, capture_output=True, text=True, env=tool_env(), timeout=600)


def family_cases() -> list[str]:
    """Every family row of the test table as the harness's `label op a b` arguments: the op's
    Scalar arguments padded to two with 0.0, written so that strtod reads back the same double
    (repr: the shortest exact spelling, "nan" included)."""
    argv = []
    for c in CASES:
        if c.op == "relu":
            continue
        args = [float(a) for a in c.args] + [0.0] * (2 - len(c.args))
        assert len(args) == 2, f"{c.id}: the harness takes two arguments, the row has {c.args}"
        argv += [c.id, c.op, *map(repr, args)]
    return argv


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    """The harness, built with AddressSanitizer where the compiler can."""
    tmp = tmp_path_factory.mktemp("cuda_emulation")
    exe = tmp / "cuda_emulation"
    built = _compile(exe, SANITIZE)
    if built.returncode != 0:
        probe = tmp / "probe.cpp"
        probe.write_text("int main() { return 0; }\n")
        no_asan = subprocess.run([_cxx(), *SANITIZE, str(probe), "-o", str(tmp / "p")],
                                 capture_output=True, text=True, env=tool_env())
        assert no_asan.returncode != 0, f"the harness did not compile:\n{built.stderr[-4000:]}"
        warnings.warn("this compiler cannot build with AddressSanitizer: the emulation runs without it")
        built = _compile(exe, [])
        assert built.returncode == 0, f"the harness did not compile:\n{built.stderr[-4000:]}"
    return exe


def _run(exe: Path, argv: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = dict(tool_env(), ASAN_OPTIONS="detect_leaks=0:detect_stack_use_after_return=0")
    return subprocess.run([str(exe), *argv], capture_output=True, text=True, env=env, timeout=timeout)


def test_cuda_kernels_emulated_on_the_cpu(harness):
    run = _run(harness, family_cases(), timeout=600)
    assert run.returncode == 0 and "emulation: all passed" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
    checked = re.findall(r"^emulation: checked family case (\S+) \((\w+)\)$", run.stdout, re.M)
    want = [(c.id, c.op) for c in CASES if c.op != "relu"]
    assert checked == want, f"the harness ran {checked}, the test table has {want}"
    checks = int(run.stdout.split("all passed (")[1].split()[0])
    assert checks > 1_000_000, run.stdout


def test_unknown_op_fails(harness):
    """A case whose op is no family trait (relu included) stops the harness before it checks anything."""
    for op in ("no_such_op", "relu"):
        run = _run(harness, ["relu6", "hardtanh", "0.0", "6.0", "bad", op, "0.0", "0.0"], timeout=60)
        assert run.returncode != 0 and f"no family activation '{op}'" in run.stderr, run.stdout + run.stderr
        assert "checked" not in run.stdout, run.stdout
