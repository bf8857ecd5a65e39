"""The CUDA device code, run on the CPU by tests/activations/cuda_emulation.cpp (one
fiber per lane, ballots and shuffles across the 32 lanes of a warp): every kernel, dtype,
vector width and unroll against the element-wise contract, at every row,
group and mask-word edge and past several grid-stride passes, with guards
around every output and AddressSanitizer on every input. It needs no GPU, so
CI checks the kernels' logic; tests/activations/test_cuda.py checks them on a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from pathlib import Path

from conftest import tool_env
from torch.utils import cpp_extension

HARNESS = Path(__file__).with_name("cuda_emulation.cpp")
CSRC = next(p / "csrc" for p in Path(__file__).resolve().parents if (p / "csrc").is_dir())  # the kernels' includes
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def _cxx() -> str:
    return os.environ.get("CXX") or shutil.which("c++") or "g++"


def _compile(out: Path, extra: list[str]) -> subprocess.CompletedProcess:
    includes = [f"-I{CSRC}"] + [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd = [_cxx(), "-std=c++20", "-O1", "-g0", "-fno-strict-aliasing", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas", *extra,
           *includes, str(HARNESS), "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=tool_env(), timeout=600)


def test_cuda_kernels_emulated_on_the_cpu(tmp_path):
    exe = tmp_path / "cuda_emulation"
    built = _compile(exe, SANITIZE)
    if built.returncode != 0:
        probe = tmp_path / "probe.cpp"
        probe.write_text("int main() { return 0; }\n")
        no_asan = subprocess.run([_cxx(), *SANITIZE, str(probe), "-o", str(tmp_path / "p")],
                                 capture_output=True, text=True, env=tool_env())
        assert no_asan.returncode != 0, f"the harness did not compile:\n{built.stderr[-4000:]}"
        warnings.warn("this compiler cannot build with AddressSanitizer: the emulation runs without it")
        built = _compile(exe, [])
        assert built.returncode == 0, f"the harness did not compile:\n{built.stderr[-4000:]}"
    env = dict(tool_env(), ASAN_OPTIONS="detect_leaks=0:detect_stack_use_after_return=0")
    run = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0 and "emulation: all passed" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
    checks = int(run.stdout.split("(")[1].split()[0])
    assert checks > 1_000_000, run.stdout
