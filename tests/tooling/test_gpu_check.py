"""bench/gpu_check.sh, checked without a GPU: its interface, its refusal when
no GPU is visible, its dry run, the sanitizer's test selection (pytest must
collect every entry), and its step logic, run against stand-ins for
nvidia-smi, python and compute-sanitizer."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"
BASH = shutil.which("bash")

pytestmark = pytest.mark.skipif(BASH is None, reason="bash not found")


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _path_without_nvidia_smi(tmp_path: Path) -> str:
    """A PATH with every command of the current one except nvidia-smi (links
    in one folder: dropping whole folders would drop sed, date and the like)."""
    farm = tmp_path / "path-without-nvidia-smi"
    farm.mkdir()
    for d in os.environ.get("PATH", "").split(os.pathsep):
        if not d or not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            src = os.path.join(d, name)
            if name != "nvidia-smi" and not (farm / name).exists() and os.access(src, os.X_OK) \
                    and os.path.isfile(src):
                (farm / name).symlink_to(src)
    assert not (farm / "nvidia-smi").exists()
    return str(farm)


def _logging_python(tmp_path: Path, log: Path) -> Path:
    """The real interpreter behind a wrapper that notes each call's arguments."""
    args = "${@//$'\\n'/ }"  # one line per call
    return _executable(tmp_path / "python-logged",
                       f'#!/usr/bin/env bash\necho "{args}" >> "{log}"\nexec "{sys.executable}" "$@"\n')


def sanitizer_selection() -> list[str]:
    out = run("--list-sanitizer-tests")
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


# --- interface ------------------------------------------------------------------------

def test_script_is_strict_bash():
    text = SCRIPT.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text and "PYTHONUNBUFFERED=1" in text
    syntax = subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_help_documents_usage_and_device_tool_calls():
    out = run("--help")
    assert out.returncode == 0, out.stderr
    for needle in ("Usage:", "--out DIR", "--steps", "--quick", "--dry-run", "--deadline",
                   '--out "$OUT" --steps build,test,sanitize', '--steps models --deadline 330',
                   'PYTEST_ADDOPTS="-n 12"',  # the whole suite fits a 10-minute call only with pytest-xdist
                   "pip install --no-build-isolation", "compute-sanitizer", "relu_ext.bench --device cuda"):
        assert needle in out.stdout, needle
    assert "set -euo" not in out.stdout, "the help should stop at the header"
    assert run("-h").stdout == out.stdout


@pytest.mark.parametrize("args, named", [
    (["--frobnicate"], "--frobnicate"),
    (["--steps", "build,frobnicate"], "frobnicate"),
    (["--sanitizer-tools", "memcheck,leakcheck"], "leakcheck"),
    (["--deadline", "soon"], "soon"),
    (["--deadline", "10"], "--deadline"),
    (["--out"], "--out"),
])
def test_bad_arguments_are_refused_by_name(args, named):
    out = run(*args)
    assert out.returncode == 2
    assert named in out.stderr and "--help" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# --- refusal without a GPU ----------------------------------------------------------

def test_refuses_without_nvidia_smi(tmp_path):
    log = tmp_path / "python-calls"
    env = dict(os.environ, PATH=_path_without_nvidia_smi(tmp_path), CUDA_VISIBLE_DEVICES="",
               PYTHON=str(_logging_python(tmp_path, log)))
    start = time.monotonic()
    out = run("--out", str(tmp_path / "results"), env=env)
    took = time.monotonic() - start
    assert out.returncode == 3, out.stdout + out.stderr
    assert out.stderr.strip() == "gpu_check.sh: refusing to run: no GPU visible (nvidia-smi is not on PATH)"
    assert took < 10, f"refusal took {took:.1f}s"
    assert not log.exists(), "python was called before refusing: " + log.read_text()
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("smi", ["lists-a-gpu", "fails"])
def test_refuses_when_torch_sees_no_gpu(tmp_path, smi):
    """nvidia-smi answers (a stand-in: it may even list a GPU) but CUDA_VISIBLE_DEVICES
    hides every GPU from torch, or nvidia-smi itself fails: refused, before any build."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    body = 'echo "GPU 0: Stand-in GPU (UUID: GPU-0)"' if smi == "lists-a-gpu" else \
        'echo "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver."; exit 9'
    _executable(bin_dir / "nvidia-smi", f"#!/bin/sh\n{body}\n")
    log = tmp_path / "python-calls"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="",
               PYTHON=str(_logging_python(tmp_path, log)))
    start = time.monotonic()
    out = run("--out", str(tmp_path / "results"), env=env)
    took = time.monotonic() - start
    assert out.returncode == 3, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check.sh: refusing to run: no GPU visible"), out.stderr
    if smi == "lists-a-gpu":
        assert "torch.cuda.is_available() is False" in lines[0] and "CUDA_VISIBLE_DEVICES=''" in lines[0]
        calls = log.read_text().splitlines()
        assert len(calls) == 1 and calls[0].startswith("-c # gpu_check:probe"), calls
    else:
        assert "nvidia-smi -L failed" in lines[0] and not log.exists()
    assert took < 60, f"refusal took {took:.1f}s"
    assert not (tmp_path / "results").exists()


# --- dry run ----------------------------------------------------------------------------

def test_dry_run_lists_every_step_and_touches_nothing(tmp_path):
    log = tmp_path / "python-calls"
    # The script's defaults (a GPU image may set TORCH_CUDA_ARCH_LIST, e.g. 9.0a, which the script then takes)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CUDA_ARCH_LIST", "MAX_JOBS")}
    env.update(PATH=_path_without_nvidia_smi(tmp_path), PYTHON=str(_logging_python(tmp_path, log)))
    out = run("--dry-run", "--out", str(tmp_path / "results"), env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16" in text and "-m pip install -v --no-build-isolation --no-deps -e ." in text
    assert "-m pytest --full tests " in text and f"--junitxml={tmp_path / 'results'}/junit.xml" in text
    for tool in ("memcheck", "racecheck", "synccheck"):
        assert f"compute-sanitizer --tool {tool} --error-exitcode" in text
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck" in text
    assert "--target-processes all" in text
    assert f"-m relu_ext.bench --device cuda --out {tmp_path / 'results'} --name bench" in text
    assert "env -u PYTEST_ADDOPTS PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer" in text
    for w in (1, 0):
        for k in (1, 2, 4):
            what = "kernels,family" if k == 4 else "kernels"
            assert (f"-m relu_ext.bench --device cuda --cuda-unroll {k} --cuda-waves {w} --what {what} "
                    "--impls torch,relu_ext") in text
    assert f"bench/gpu_models.py --device cuda --out {tmp_path / 'results'} --deadline 240" in text
    for node in sanitizer_selection():
        assert node in text
    assert not (tmp_path / "results").exists() and not log.exists()


def test_dry_run_follows_steps_and_quick(tmp_path):
    out = run("--dry-run", "--steps", "bench", "--quick", "--out", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    assert "relu_ext.bench" in out.stdout and "--sizes 65536,1048576,16777216,268435456" in out.stdout
    assert "pip install" not in out.stdout and "-m pytest" not in out.stdout and "compute-sanitizer" not in out.stdout
    assert "only if no CUDA build" in out.stdout
    out = run("--dry-run", "--steps", "test,sanitize", "--sanitizer-tools", "memcheck")
    assert "-m pytest --full tests" in out.stdout and "--tool memcheck" in out.stdout
    assert "--tool racecheck" not in out.stdout and "relu_ext.bench" not in out.stdout
    assert "bench/results/gpu-<device-slug>-" in out.stdout


# --- the sanitizer's selection --------------------------------------------------------

@pytest.mark.full  # a pytest collection in a process of its own (~10 s)
def test_sanitizer_selection_is_collected_by_pytest():
    """Every entry is a node id (or file) that pytest collects, with no collection error."""
    selection = sanitizer_selection()
    assert 5 <= len(selection) <= 30, "keep the sanitizer's selection small"
    assert len(set(selection)) == len(selection), "duplicate entries"
    for entry in selection:
        path = entry.split("::")[0]
        assert (REPO / path).is_file(), entry
        assert "::" not in entry or entry.split("::")[0].startswith("tests/"), entry
        assert "[" not in entry or "cuda" in entry or path == "tests/activations/test_cuda.py", f"{entry}: not a CUDA variant"
    assert any(e.startswith("tests/activations/test_cuda.py::") for e in selection)
    assert any("inplace" in e for e in selection) and any("backward" in e or "autograd" in e for e in selection)
    out = subprocess.run([sys.executable, "-m", "pytest", "--full", "--collect-only", "-q", "-p", "no:cacheprovider",
                          *selection],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not re.search(r"\berrors?\b", out.stdout.lower()), out.stdout[-3000:]
    collected = [line.strip() for line in out.stdout.splitlines() if "::" in line]
    for entry in selection:
        hits = [c for c in collected if c == entry or c.startswith(entry + "[") or c.startswith(entry + "::")
                or (entry.endswith(".py") and c.startswith(entry + "::"))]
        assert hits, f"pytest collected nothing for {entry}"


# --- step logic, against stand-ins ------------------------------------------------------

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "python $* | caching-off=${PYTORCH_NO_CUDA_MEMORY_CACHING:-} sanitizer=${FAKE_UNDER_SANITIZER:-} addopts=${PYTEST_ADDOPTS:-}" >> "$FAKE_LOG"
case "$1" in
  -c)
    case "$2" in
      *gpu_check:probe*) echo "Stand-in GPU 80GB HBM3"; exit 0 ;;
      *gpu_check:has-build*) exit "${FAKE_HAS_BUILD_RC:-0}" ;;
    esac ;;
  -)
    code=$(cat)
    case "$code" in
      *gpu_check:env*) echo '{"device": "Stand-in GPU 80GB HBM3"}' > "$GC_ENV_OUT"; exit 0 ;;
      *gpu_check:build-check*) echo "gpu_check: relu_ext has CUDA kernels for 9.0 and they run"; exit 0 ;;
    esac ;;
  -m)
    case "$2" in
      pip) echo "stand-in pip: $*"; exit "${FAKE_PIP_RC:-0}" ;;
      pytest)
        if [ -n "${FAKE_UNDER_SANITIZER:-}" ]; then echo "14 passed in 9.00s"; exit 0; fi
        for a in "$@"; do case "$a" in --junitxml=*) echo "<testsuites/>" > "${a#--junitxml=}" ;; esac; done
        echo "2 failed, 900 passed, 40 skipped in 100.00s"; exit "${FAKE_TEST_RC:-0}" ;;
      relu_ext.bench)
        out=. name=x files=1 unroll=default waves=default
        while [ $# -gt 0 ]; do
          case "$1" in
            --out) out=$2; shift ;; --name) name=$2; shift ;; --no-files) files=0 ;;
            --cuda-unroll) unroll=$2; shift ;; --cuda-waves) waves=$2; shift ;;
          esac
          shift
        done
        echo "STAND-IN KERNEL TABLE unroll=$unroll waves=$waves"
        [ "$files" = 1 ] && { echo "{}" > "$out/$name.json"; echo png > "$out/$name.png"; }
        exit "${FAKE_BENCH_RC:-0}" ;;
    esac ;;
  bench/gpu_models.py)
    out=.
    while [ $# -gt 0 ]; do case "$1" in --out) out=$2; shift ;; esac; shift; done
    echo "STAND-IN MODELS TABLE"
    echo "{}" > "$out/gpu_models.json"
    exit "${FAKE_MODELS_RC:-0}" ;;
esac
echo "stand-in python: unexpected call: $*" >&2
exit 97
"""

FAKE_SANITIZER = r"""#!/usr/bin/env bash
echo "compute-sanitizer $* | caching-off=${PYTORCH_NO_CUDA_MEMORY_CACHING:-}" >> "$FAKE_LOG"
tool="" code=1
while [ $# -gt 0 ]; do
  case "$1" in
    --tool) tool=$2; shift 2 ;;
    --error-exitcode) code=$2; shift 2 ;;
    --target-processes|--report-api-errors|--print-limit) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
FAKE_UNDER_SANITIZER=1 "$@"; rc=$?
case ",${FAKE_SANITIZER_ERRORS:-}," in
  *",$tool,"*) echo "========= ERROR SUMMARY: 3 errors"; exit "$code" ;;
esac
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
"""


@pytest.fixture
def stand_ins(tmp_path):
    """nvidia-smi, python and compute-sanitizer stand-ins; returns (env, log path, results folder)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "nvidia-smi", '#!/bin/sh\necho "GPU 0: Stand-in GPU 80GB HBM3 (UUID: GPU-0)"\n')
    _executable(bin_dir / "compute-sanitizer", FAKE_SANITIZER)
    python = _executable(bin_dir / "python-stand-in", FAKE_PYTHON)
    log = tmp_path / "calls"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=str(python),
               FAKE_LOG=str(log))
    return env, log, tmp_path / "results"


def _summary_rows(results: Path) -> dict[str, str]:
    rows = {}
    for line in (results / "summary.txt").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] != "overall:" and parts[1] in ("PASS", "FAIL", "TIMEOUT", "SKIPPED"):
            rows[parts[0]] = parts[1]
    return rows


def test_a_failed_test_step_does_not_stop_sanitizer_and_bench(stand_ins):
    env, log, results = stand_ins
    out = run("--out", str(results), env=dict(env, FAKE_TEST_RC="1", PYTEST_ADDOPTS="-n 12"))
    assert out.returncode == 1, out.stdout + out.stderr
    assert _summary_rows(results) == {"build": "PASS", "test": "FAIL", "sanitize:memcheck": "PASS",
                                      "sanitize:racecheck": "PASS", "sanitize:synccheck": "PASS", "bench": "PASS",
                                      "unroll": "PASS", "models": "PASS"}
    summary = (results / "summary.txt").read_text()
    assert "overall: FAIL" in summary and "2 failed, 900 passed" in summary
    assert "STAND-IN KERNEL TABLE unroll=default" in summary, "the bench's tables belong at the end of the summary"
    for k in (1, 2, 4):
        assert f"STAND-IN KERNEL TABLE unroll={k}" in summary
    assert "STAND-IN MODELS TABLE" in summary, "the models' table belongs at the end of the summary"
    files = sorted(p.name for p in results.iterdir())
    assert files == ["bench.json", "bench.png", "build.log", "env.json", "gpu_models.json", "junit.xml",
                     "sanitizer.log", "summary.txt", "tests.log"]
    assert json.loads((results / "env.json").read_text())["device"] == "Stand-in GPU 80GB HBM3"
    calls = log.read_text()
    assert re.search(r"python -m pip install -v --no-build-isolation --no-deps -e \.", calls)
    memcheck = [c for c in calls.splitlines() if c.startswith("compute-sanitizer --tool memcheck")]
    racecheck = [c for c in calls.splitlines() if c.startswith("compute-sanitizer --tool racecheck")]
    assert memcheck and memcheck[0].endswith("caching-off=1"), "memcheck must see real allocation bounds"
    assert racecheck and racecheck[0].endswith("caching-off="), "CUDA graphs need the caching allocator"
    for node in sanitizer_selection():
        assert node in memcheck[0]
    pytests = [c for c in calls.splitlines() if c.startswith("python -m pytest")]
    under_sanitizer = [c for c in pytests if "sanitizer=1" in c]
    assert len(under_sanitizer) == 3 and all(c.endswith("addopts=") for c in under_sanitizer), \
        "the sanitizer runs one pytest process: no workers from PYTEST_ADDOPTS"
    assert any(c.endswith("addopts=-n 12") for c in pytests if "sanitizer=1" not in c), "the test step keeps them"
    assert "overall: FAIL" in out.stdout and "PASS" in out.stdout


def test_each_call_of_the_device_plan_brings_back_at_most_8_files(stand_ins, tmp_path):
    """The plan in --help: call 1 (build, test, sanitize) and call 2 (models, then bn_probe's one file)
    each leave at most 8 files in $OUT, all the device tool brings back."""
    env, _, _ = stand_ins
    for n, steps in enumerate(("build,test,sanitize", "models")):
        out_dir = tmp_path / f"call{n}"
        out = run("--out", str(out_dir), "--steps", steps, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        assert len(list(out_dir.iterdir())) + (n == 1) <= 8, sorted(p.name for p in out_dir.iterdir())
    assert "--steps build,test,sanitize" in run("--help").stdout and "--steps models" in run("--help").stdout


def test_all_passing_exits_zero(stand_ins):
    env, _, results = stand_ins
    out = run("--out", str(results), "--quick", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert set(_summary_rows(results).values()) == {"PASS"} and "overall: PASS" in out.stdout


def test_a_failed_build_skips_the_rest(stand_ins):
    env, log, results = stand_ins
    out = run("--out", str(results), env=dict(env, FAKE_PIP_RC="1"))
    assert out.returncode == 1
    assert _summary_rows(results) == {"build": "FAIL", "test": "SKIPPED", "sanitize:memcheck": "SKIPPED",
                                      "sanitize:racecheck": "SKIPPED", "sanitize:synccheck": "SKIPPED",
                                      "bench": "SKIPPED", "unroll": "SKIPPED", "models": "SKIPPED"}
    calls = log.read_text()
    assert "-m pytest" not in calls and "relu_ext.bench" not in calls and "compute-sanitizer --tool" not in calls


def test_sanitizer_errors_fail_their_row(stand_ins):
    env, _, results = stand_ins
    out = run("--out", str(results), "--steps", "sanitize", env=dict(env, FAKE_SANITIZER_ERRORS="racecheck"))
    assert out.returncode == 1
    assert _summary_rows(results) == {"sanitize:memcheck": "PASS", "sanitize:racecheck": "FAIL",
                                      "sanitize:synccheck": "PASS"}
    assert "SANITIZER ERRORS" in (results / "sanitizer.log").read_text()
    assert "SANITIZER ERRORS" in (results / "summary.txt").read_text()


def test_unroll_step_runs_every_unroll_even_after_a_failure(stand_ins):
    env, log, results = stand_ins
    out = run("--out", str(results), "--steps", "unroll", env=dict(env, FAKE_BENCH_RC="1"))
    assert out.returncode == 1
    assert _summary_rows(results) == {"unroll": "FAIL"}
    calls = [c for c in log.read_text().splitlines() if "relu_ext.bench" in c]
    variants = [re.search(r"--cuda-unroll (\d) --cuda-waves (\d) --what (\S+)", c).groups() for c in calls]
    assert variants == [(k, w, "kernels,family" if k == "4" else "kernels") for w in "10" for k in "124"]
    assert all("--no-files" in c for c in calls)
    assert sorted(p.name for p in results.iterdir()) == ["env.json", "summary.txt"]


@pytest.mark.parametrize("has_build", [True, False])
def test_builds_first_only_when_no_cuda_build_is_importable(stand_ins, has_build):
    """A later call may land on a bare machine: without the build step, a missing build is made first."""
    env, log, results = stand_ins
    out = run("--out", str(results), "--steps", "bench", env=dict(env, FAKE_HAS_BUILD_RC="0" if has_build else "1"))
    assert out.returncode == 0, out.stdout + out.stderr
    built = "-m pip install" in log.read_text()
    assert built is not has_build
    assert _summary_rows(results) == ({"bench": "PASS"} if has_build else {"build:auto": "PASS", "bench": "PASS"})
