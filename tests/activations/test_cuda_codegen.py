"""What nvcc made of the CUDA kernels, read from the built extension's sm_90
SASS with cuobjdump (needs no GPU). The element-wise kernels must store each
full row with one 16-byte store: nvcc (13.0) once split some of them into 4
to 8 narrow stores, which cost bfloat16 forwards up to 2.6x on an H200 and
which no test of values can see."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import tool_env

import relu_ext
from relu_ext import _C

pytestmark = pytest.mark.skipif(not _C.with_cuda, reason="built without CUDA kernels")

# Mangled names of the vector kernels: V elements a lane and K rows in flight.
# expand_kernel<U, V> always has 4 rows in flight (kRowsInFlight).
_ROWS = re.compile(r"\d(fwd_kernel|bwd_kernel|act_fwd_kernel|act_bwd_kernel)I\w*?Li(\d)ELi(\d)EEEv")
_EXPAND = re.compile(r"expand_kernelI\w*?Li(\d)EEEv")


def _cuobjdump() -> str | None:
    """cuobjdump from the CUDA toolkit, or the one triton ships (a dependency of torch)."""
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    found = shutil.which("cuobjdump") or (f"{home}/bin/cuobjdump" if Path(f"{home}/bin/cuobjdump").exists() else None)
    spec = importlib.util.find_spec("triton")
    if found is None and spec is not None and spec.origin is not None:
        candidate = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        found = str(candidate) if candidate.exists() else None
    return found


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Runs a tool without the sanitizer leg's preloaded ASan runtime (a leak report in
    cuobjdump would fail its exit status)."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=tool_env())


def _sass_functions(text: str) -> dict[str, list[str]]:
    """Instructions of each function in `cuobjdump -sass` output, by mangled name."""
    functions: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        head = re.match(r"\s+Function : (\S+)", line)
        if head:
            current = functions.setdefault(head.group(1), [])
        elif current is not None and re.match(r"\s+/\*[0-9a-f]{4}\*/", line):
            current.append(line.split("*/", 1)[1].split(";")[0].strip())
    return functions


def _row_store_problems(functions: dict[str, list[str]]) -> tuple[int, list[str]]:
    """(kernels checked, what is wrong): a vector kernel with fewer 16-byte stores
    (STG.E.128, predicated or not) than rows in flight, or one storing 16-bit
    elements without a predicate (only the tail stores elements one by one,
    each under its own bounds predicate)."""
    checked, problems = 0, []
    for name, code in functions.items():
        rows = _ROWS.search(name)
        expand = _EXPAND.search(name)
        if rows:
            v, k = int(rows.group(2)), int(rows.group(3))
        elif expand:
            v, k = int(expand.group(1)), 4
        else:
            continue
        if v == 1:
            continue
        checked += 1
        wide = sum(1 for ins in code if re.sub(r"^@!?P\w+\s+", "", ins).startswith("STG.E.128"))
        narrow16 = [ins for ins in code if ins.startswith("STG.E.U16")]
        if wide < k:
            problems.append(f"{name}: {wide} 16-byte stores for {k} rows")
        if narrow16:
            problems.append(f"{name}: {len(narrow16)} unpredicated 16-bit stores, e.g. {narrow16[0]}")
    return checked, problems


def test_full_rows_are_stored_with_16_byte_stores():
    tool = _cuobjdump()
    assert tool is not None, "no cuobjdump (CUDA toolkit or triton's) to read the kernels with"
    library = Path(_C.__file__)
    listed = _run([tool, "-lelf", str(library)])
    assert listed.returncode == 0, listed.stderr
    arch = re.search(r"\.(sm_90a?)\.cubin", listed.stdout)
    if arch is None:
        pytest.skip(f"this build has no sm_90 code ({relu_ext.build_info()['cuda_arch_list']})")
    sass = _run([tool, "-sass", "-arch", arch.group(1), str(library)])
    assert sass.returncode == 0, sass.stderr
    checked, problems = _row_store_problems(_sass_functions(sass.stdout))
    # ReLU: forwards of 4 formats and backwards of 3 widths, x 3 unrolls; the family: 4 activations
    # x 4 dtypes x (forward, backward); expand: 3 widths.
    assert checked >= 12 + 9 + 32 + 3, f"only {checked} vector kernels found in the SASS"
    assert not problems, "\n".join(problems)


def test_the_check_sees_split_stores():
    """The parser on a made-up function: a row stored as 16-bit pieces is reported."""
    name = "_ZN8relu_ext10fwd_kernelItLt32640ELi8ELi2EEEvPKT_PS2_Phl"
    sass = (f"\t\tFunction : {name}\n"
            "        /*0000*/                   STG.E.128 desc[UR6][R12.64], R4 ;  /* 0x0 */\n"
            "        /*0010*/                   STG.E.U16 desc[UR6][R4.64], R25 ;  /* 0x0 */\n"
            "        /*0020*/              @!P0 STG.E.U16 desc[UR6][R4.64+0x2], R23 ;  /* 0x0 */\n")
    checked, problems = _row_store_problems(_sass_functions(sass))
    assert checked == 1 and len(problems) == 2, problems
