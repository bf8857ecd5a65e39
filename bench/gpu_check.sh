#!/usr/bin/env bash
# gpu_check.sh: the GPU check of relu_ext (issue 10) in one command.
#
# Usage: bash bench/gpu_check.sh [--out DIR] [--steps LIST] [--quick] [--deadline SECONDS]
#                                [--sanitizer-tools LIST] [--dry-run] [--list-sanitizer-tests] [-h|--help]
#
# On a machine with a GPU, torch with CUDA, nvcc and no network, from the repository root:
#   build     TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -e .
#             then relu_ext.build_info()["cuda"] must be True and a CUDA relu must run (build.log)
#   test      python3 -m pytest --full tests: the full tier, CUDA variants included (tests.log, junit.xml)
#   sanitize  compute-sanitizer memcheck, racecheck and synccheck over a small fixed selection of CUDA
#             tests, SANITIZER_TESTS in this script (--list-sanitizer-tests), into sanitizer.log;
#             memcheck runs with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (real allocation bounds)
#   bench     python3 -m relu_ext.bench --device cuda --out DIR --name bench (bench.json, bench.png;
#             its printed tables go to the end of summary.txt)
#   unroll    the kernel section at 16M and 256M elements (float32, bfloat16; torch, relu_ext and the
#             copy) once per compiled unroll of relu_ext's CUDA kernels (--cuda-unroll 1, 2, 4) and grid cap
#             (--cuda-waves 1: one wave of resident blocks; 0: no cap), the family's rows too with unroll 4: which
#             one to make the default (tables at the end of summary.txt, ~1-2 min)
#   models    real models at GPU sizes (bench/gpu_models.py: resnet50 float32 and bfloat16 autocast,
#             Llama, GPT-2, mobilenet_v2, densenet121, T5, then other transformers) under nn.ReLU,
#             install(), install()+save_compact(), torch.compile and selective checkpointing: peak
#             memory, held bytes, step time, host syncs per step (gpu_models.json;
#             its table at the end of summary.txt; it starts no model past MODELS_DEADLINE_S, ~5 min)
# It refuses at once (exit 3, one line, nothing built) when no GPU is visible: nvidia-smi missing or
# failing, or torch.cuda.is_available() False. It records the environment (env.json), runs every step
# asked for even after a failed one (except that nothing runs after a failed build), prints a summary
# table (summary.txt, for this invocation) and exits 1 if any step failed, 0 if all passed.
#
# Options:
#   --out DIR              results folder (default: bench/results/gpu-<device-slug>-<date>/)
#   --steps LIST           comma-separated, from build,test,sanitize,bench,unroll,models (default: all
#                          six, in that order). Without build, a missing CUDA build is built first (a fresh machine).
#   --quick                smaller bench: sizes 64K,1M,16M,256M, sections kernels,small, budget 0.2 s
#   --deadline SECONDS     stop starting steps, and stop a running one, so the whole run ends by then
#                          (with 20 s kept for the summary); a step cut short is a TIMEOUT (failed)
#   --sanitizer-tools LIST compute-sanitizer tools (default: memcheck,racecheck,synccheck)
#   --dry-run              print what would run and stop (no GPU check, no build, no files)
#   --list-sanitizer-tests print the sanitizer's test selection, one pytest node id per line
#   -h, --help             this text
# Environment: PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS (default 16),
#   GIT_COMMIT (recorded when the tree has no .git), PYTEST_ADDOPTS (extra pytest options, as usual),
#   BENCH_ARGS (extra arguments for relu_ext.bench), CUDA_HOME (default /usr/local/cuda).
#
# Through the device tool (one command runs at most 10 minutes, 15 minutes of device time a session,
# and $OUT comes back: at most 8 files). Measured on an H100 with 16 cores (2026-11-26): start about
# 1 min; build 60 s (one arch); the whole suite 264 s with pytest-xdist (without it, more than 10 min;
# an H200 the same day: 350 s); the three sanitizer tools 90 s (one pytest process each: the sanitize
# step drops PYTEST_ADDOPTS); bench --quick 94 s; unroll 111 s (6 variants, H200). The image has no
# expecttest (one test of the OpInfo samples skips without it): carry its wheel.
#   call 1, ~8 min:  PYTEST_ADDOPTS="-n 12" OMP_NUM_THREADS=1 \
#                    bash bench/gpu_check.sh --out "$OUT" --steps build,test,sanitize --deadline 570
#   call 2, ~6 min, at once on the still-warm machine (it goes back after 30 s idle; without build the
#                    installed one is used): bash bench/gpu_check.sh --out "$OUT" --steps models --deadline 330
#                    && python3 bench/bn_probe.py --device cuda --out "$OUT/bn_probe"   (seconds; needs no
#                    build: which formula gives CUDA's BatchNorm output, for a CUDA replay)
#   later sessions: --steps bench --quick, --steps unroll; the real models compiled (torch.compile,
#                    nn.ReLU vs relu_ext): BENCH_ARGS="--what compiled --models resnet18,resnet50,vgg11 \
#                    --dtypes float32" bash bench/gpu_check.sh --out "$OUT" --steps build,bench --deadline 570
# On a machine without a time limit, `bash bench/gpu_check.sh` runs all six steps (~20-25 min) into
# bench/results/gpu-<device-slug>-<date>/.
set -euo pipefail

# The sanitizer's test selection: the one place it is defined (tests/tooling/test_gpu_check.py reads it
# through --list-sanitizer-tests and checks that pytest collects every entry). CUDA variants only,
# a few sizes and dtypes, forward, backward, in place, unaligned, integers, streams and graphs.
SANITIZER_TESTS=(
  "tests/activations/test_exact.py::test_forward_backward_bitwise[scalar-33-torch.float32-cuda]"
  "tests/activations/test_exact.py::test_forward_backward_bitwise[scalar-4097-torch.float16-cuda]"
  "tests/activations/test_exact.py::test_forward_backward_bitwise[scalar-1000003-torch.bfloat16-cuda]"
  "tests/activations/test_exact.py::test_forward_backward_bitwise[scalar-1023-torch.float64-cuda]"
  "tests/activations/test_exact.py::test_inplace_matches_pytorch[scalar-4097-torch.float32-cuda]"
  "tests/activations/test_exact.py::test_special_values[torch.bfloat16-cuda]"
  "tests/activations/test_exact.py::test_gradient_select_not_product[torch.float16-cuda]"
  "tests/activations/test_exact.py::test_integer_dtypes_like_torch[4097-torch.int8-cuda]"
  "tests/activations/test_exact.py::test_expanded_gradient[cuda]"
  "tests/activations/test_cuda.py::test_kernels_match_cpu_kernels[unroll4-torch.float32]"
  "tests/activations/test_cuda.py::test_kernels_match_cpu_kernels[unroll2-torch.bfloat16]"
  "tests/activations/test_cuda.py::test_side_stream[torch.float32]"
  "tests/activations/test_cuda.py::test_cuda_graph_replay_ops[torch.float16]"
  "tests/activations/test_cuda.py::test_cuda_graph_replay_autograd[out_of_place-torch.float32]"
  "tests/compact/test_compact.py::test_ops_against_a_reference[scalar-300001-torch.float32-cuda]"
  "tests/compact/test_compact.py::test_ops_against_a_reference[scalar-32769-torch.bfloat16-cuda]"
  "tests/compact/test_compact.py::test_ops_keep_layouts[scalar-cuda]"
  "tests/compact/test_compact.py::test_restored_bit_for_bit[relu_ext-torch.float64-cuda]"
  "tests/activations/test_family.py::test_every_op_of_the_table[cuda]"
  "tests/activations/test_family.py::test_bitwise_against_pytorch[scalar-relu6-4097-torch.float32-cuda]"
  "tests/activations/test_family.py::test_bitwise_against_pytorch[scalar-leaky-100003-torch.bfloat16-cuda]"
  "tests/activations/test_family.py::test_bitwise_against_pytorch[scalar-threshold_odd-65-torch.float16-cuda]"
  "tests/activations/test_family.py::test_bitwise_against_pytorch[scalar-hardsigmoid-63-torch.float64-cuda]"
  "tests/activations/test_family.py::test_inplace_bitwise_against_pytorch[scalar-hardtanh_odd-torch.float32-cuda]"
  "tests/compact/test_recompute.py::test_cuda_replay_matches_pytorch[torch.bfloat16-2x37x5x3-channels_last-eval]"
  "tests/compact/test_recompute.py::test_cuda_residual_replay_matches_pytorch[torch.float32]"
)
STEP_NAMES=(build test sanitize bench unroll models)
MODELS_DEADLINE_S=240  # gpu_models.py starts no model after this (one model takes up to a minute)
QUICK_BENCH_ARGS=(--sizes 65536,1048576,16777216,268435456 --what kernels,small --budget 0.2)
UNROLLS=(1 2 4)  # what csrc/activations/cuda.cu compiles (set_cuda_unroll); the family's kernels have 4 only
WAVES=(1 0)      # grid caps to compare (set_cuda_waves): one wave of resident blocks, none
UNROLL_BENCH_ARGS=(--impls torch,relu_ext --sizes 16777216,268435456 --dtypes float32,bfloat16
                   --rounds 3 --budget 0.1 --no-files --no-progress)
SANITIZER_ERROR_EXIT=99  # not 1, so that "the sanitizer found errors" differs from "a test failed"
RESERVE_S=20             # kept for the summary under --deadline

T0=$SECONDS  # --deadline counts from here
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

die_usage() { echo "gpu_check.sh: $*; see --help" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }

# --- arguments ----------------------------------------------------------------
OUT_DIR="" STEPS_ARG="" QUICK=0 DEADLINE=0 DRY_RUN=0 SANITIZER_TOOLS="memcheck,racecheck,synccheck"
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --list-sanitizer-tests) printf '%s\n' "${SANITIZER_TESTS[@]}"; exit 0 ;;
    --out) [ $# -ge 2 ] && [ -n "$2" ] || die_usage "--out needs a folder"; OUT_DIR=$2; shift 2 ;;
    --out=*) OUT_DIR=${1#--out=}; [ -n "$OUT_DIR" ] || die_usage "--out needs a folder"; shift ;;
    --steps) [ $# -ge 2 ] || die_usage "--steps needs a list"; STEPS_ARG=$2; shift 2 ;;
    --steps=*) STEPS_ARG=${1#--steps=}; shift ;;
    --deadline) [ $# -ge 2 ] || die_usage "--deadline needs seconds"; DEADLINE=$2; shift 2 ;;
    --deadline=*) DEADLINE=${1#--deadline=}; shift ;;
    --sanitizer-tools) [ $# -ge 2 ] || die_usage "--sanitizer-tools needs a list"; SANITIZER_TOOLS=$2; shift 2 ;;
    --sanitizer-tools=*) SANITIZER_TOOLS=${1#--sanitizer-tools=}; shift ;;
    --quick) QUICK=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    *) die_usage "unknown argument: $1" ;;
  esac
done
[[ "$DEADLINE" =~ ^[0-9]+$ ]] || die_usage "--deadline takes whole seconds, not '$DEADLINE'"
if [ "$DEADLINE" -gt 0 ] && [ "$DEADLINE" -le $((RESERVE_S + 30)) ]; then
  die_usage "--deadline $DEADLINE leaves no time for any step (at least $((RESERVE_S + 31)) s)"
fi

declare -A WANT=()
if [ -z "$STEPS_ARG" ]; then
  for s in "${STEP_NAMES[@]}"; do WANT[$s]=1; done
else
  IFS=',' read -r -a _steps <<<"$STEPS_ARG"
  for s in "${_steps[@]}"; do
    case "$s" in
      build|test|sanitize|bench|unroll|models) WANT[$s]=1 ;;
      *) die_usage "unknown step '$s' in --steps (steps: ${STEP_NAMES[*]})" ;;
    esac
  done
  [ ${#WANT[@]} -gt 0 ] || die_usage "--steps is empty"
fi
IFS=',' read -r -a TOOLS <<<"$SANITIZER_TOOLS"
[ ${#TOOLS[@]} -gt 0 ] || die_usage "--sanitizer-tools is empty"
for t in "${TOOLS[@]}"; do
  case "$t" in memcheck|racecheck|synccheck|initcheck) ;; *) die_usage "unknown sanitizer tool '$t'" ;; esac
done

BENCH_EXTRA=()
[ "$QUICK" = 1 ] && BENCH_EXTRA+=("${QUICK_BENCH_ARGS[@]}")
if [ -n "${BENCH_ARGS:-}" ]; then read -r -a _b <<<"$BENCH_ARGS"; BENCH_EXTRA+=("${_b[@]}"); fi

SANITIZER_TESTS_LIST="${SANITIZER_TESTS[*]}" BENCH_EXTRA_LIST="${BENCH_EXTRA[*]}"
UNROLLS_LIST="${UNROLLS[*]}" WAVES_LIST="${WAVES[*]}" UNROLL_BENCH_ARGS_LIST="${UNROLL_BENCH_ARGS[*]}"

CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
[ -d "$CUDA_HOME/bin" ] && export CUDA_HOME PATH="$PATH:$CUDA_HOME/bin"
ARCH=${TORCH_CUDA_ARCH_LIST:-9.0}
JOBS=${MAX_JOBS:-16}

# --- the commands (shared by --dry-run and the real run) ------------------------
build_cmd() { echo "TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=$JOBS $PYTHON -m pip install -v --no-build-isolation --no-deps -e ."; }
test_cmd() { echo "$PYTHON -m pytest --full tests -q -ra -p no:cacheprovider --durations=15 --junitxml=$1/junit.xml"; }
sanitizer_cmd() {  # tool
  local env="env -u PYTEST_ADDOPTS " count
  [ "$1" = memcheck ] && env+="PYTORCH_NO_CUDA_MEMORY_CACHING=1 "
  count=$(wc -w <<<"$SANITIZER_TESTS_LIST" | tr -d ' ')
  echo "${env}compute-sanitizer --tool $1 --error-exitcode $SANITIZER_ERROR_EXIT --target-processes all" \
       "--report-api-errors no --print-limit 50 $PYTHON -m pytest --full -q -p no:cacheprovider <the $count tests below>"
}
bench_cmd() { echo "$PYTHON -m relu_ext.bench --device cuda --out $1 --name bench --no-progress $BENCH_EXTRA_LIST"; }
models_cmd() { echo "$PYTHON bench/gpu_models.py --device cuda --out $1 --deadline $MODELS_DEADLINE_S"; }
unroll_what() { [ "$1" = 4 ] && echo kernels,family || echo kernels; }  # unroll
unroll_cmd() {  # unroll waves
  echo "$PYTHON -m relu_ext.bench --device cuda --cuda-unroll $1 --cuda-waves $2 --what $(unroll_what "$1") $UNROLL_BENCH_ARGS_LIST"
}

if [ "$DRY_RUN" = 1 ]; then
  results=${OUT_DIR:-$REPO/bench/results/gpu-<device-slug>-$(date +%Y-%m-%d)}
  echo "gpu_check.sh --dry-run: nothing is run, built or written"
  echo "repository: $REPO"
  echo "results:    $results"
  echo "check:      nvidia-smi -L succeeds and $PYTHON says torch.cuda.is_available(); else refuse (exit 3)"
  echo "record:     $results/env.json (device, driver, CUDA, torch, python, date, git commit)"
  [ "$DEADLINE" -gt 0 ] && echo "deadline:   ${DEADLINE}s for the whole run (steps under timeout, ${RESERVE_S}s kept for the summary)"
  [ -n "${WANT[build]:-}" ] || echo "build:      only if no CUDA build of relu_ext can be imported"
  [ -n "${WANT[build]:-}" ] && echo "step build:    $(build_cmd)  > build.log; then relu_ext.build_info()[\"cuda\"] must be True"
  [ -n "${WANT[test]:-}" ] && echo "step test:     $(test_cmd "$results")  > tests.log"
  if [ -n "${WANT[sanitize]:-}" ]; then
    for t in "${TOOLS[@]}"; do echo "step sanitize: $(sanitizer_cmd "$t")  >> sanitizer.log"; done
    printf '                 %s\n' "${SANITIZER_TESTS[@]}"
  fi
  [ -n "${WANT[bench]:-}" ] && echo "step bench:    $(bench_cmd "$results")  (tables into summary.txt)"
  if [ -n "${WANT[unroll]:-}" ]; then
    for w in "${WAVES[@]}"; do
      for k in "${UNROLLS[@]}"; do echo "step unroll:   $(unroll_cmd "$k" "$w")  (tables into summary.txt)"; done
    done
  fi
  [ -n "${WANT[models]:-}" ] && echo "step models:   $(models_cmd "$results")  (table into summary.txt)"
  echo "summary:    $results/summary.txt"
  exit 0
fi

# --- refuse without a GPU, before anything else -----------------------------------
refuse() { echo "gpu_check.sh: refusing to run: $*" >&2; exit 3; }
command -v nvidia-smi >/dev/null 2>&1 || refuse "no GPU visible (nvidia-smi is not on PATH)"
SMI_LIST=$(timeout 30 nvidia-smi -L 2>&1) || refuse "no GPU visible (nvidia-smi -L failed: $(echo "$SMI_LIST" | head -n 1))"
echo "$SMI_LIST" | grep -q '^GPU ' || refuse "no GPU visible (nvidia-smi -L lists none)"
command -v "$PYTHON" >/dev/null 2>&1 || refuse "no python: '$PYTHON' not found (set PYTHON=...)"
PROBE=$("$PYTHON" -c '# gpu_check:probe
import os, sys
try:
    import torch
except Exception as e:
    sys.exit(f"cannot import torch: {e}")
if not torch.cuda.is_available():
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    sys.exit(f"no GPU visible to torch {torch.__version__} (torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES={cvd!r})")
print(torch.cuda.get_device_name(0))
' 2>&1) || refuse "$(echo "$PROBE" | tail -n 1)"
DEVICE_NAME=$(echo "$PROBE" | tail -n 1)

DATE=$(date +%Y-%m-%d)
SLUG=$(echo "$DEVICE_NAME" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
R=${OUT_DIR:-$REPO/bench/results/gpu-${SLUG:-unknown}-$DATE}
mkdir -p "$R"
R=$(cd "$R" && pwd)
cd "$REPO"
echo "gpu_check.sh: $DEVICE_NAME; results in $R"

# --- environment ------------------------------------------------------------------
if COMMIT=$(git -C "$REPO" rev-parse HEAD 2>/dev/null); then
  DIRTY=$(git -C "$REPO" status --porcelain 2>/dev/null | wc -l | tr -d ' ')
else
  COMMIT=${GIT_COMMIT:-unknown (no .git; set GIT_COMMIT)} DIRTY=unknown
fi
SMI_CSV=$(timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null | head -n 1 || true)
nvcc_release() {
  local nvcc="$CUDA_HOME/bin/nvcc"
  [ -x "$nvcc" ] || nvcc=$(command -v nvcc 2>/dev/null) || return 0
  "$nvcc" --version 2>/dev/null | grep -i release | head -n 1 || true
}
NVCC=$(nvcc_release)
SANITIZER_BIN=$(command -v compute-sanitizer 2>/dev/null || true)
SANITIZER_VERSION=$([ -n "$SANITIZER_BIN" ] && "$SANITIZER_BIN" --version 2>/dev/null | grep -i version | head -n 1 || true)
NCU_VERSION=$(command -v ncu >/dev/null 2>&1 && ncu --version 2>/dev/null | tail -n 1 || true)
export GC_COMMIT="$COMMIT" GC_DIRTY="$DIRTY" GC_SMI="$SMI_CSV" GC_NVCC="$NVCC" GC_SAN="$SANITIZER_VERSION" \
       GC_NCU="$NCU_VERSION" GC_STEPS="${!WANT[*]}" GC_ARCH="$ARCH" GC_JOBS="$JOBS" GC_ENV_OUT="$R/env.json"
"$PYTHON" - <<'EOF' || echo "gpu_check.sh: warning: could not write env.json" >&2
# gpu_check:env
import datetime, json, os, platform, sys
import torch
p = torch.cuda.get_device_properties(0)
smi = [s.strip() for s in os.environ["GC_SMI"].split(",")] if os.environ["GC_SMI"] else []
env = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "git_commit": os.environ["GC_COMMIT"],
    "git_uncommitted_files": os.environ["GC_DIRTY"],
    "device": torch.cuda.get_device_name(0),
    "device_count": torch.cuda.device_count(),
    "compute_capability": f"{p.major}.{p.minor}",
    "multiprocessors": p.multi_processor_count,
    "gpu_memory_bytes": p.total_memory,
    "driver": smi[1] if len(smi) > 1 else None,
    "nvidia_smi": os.environ["GC_SMI"] or None,
    "cuda_torch": torch.version.cuda,
    "nvcc": os.environ["GC_NVCC"] or None,
    "cudnn": torch.backends.cudnn.version(),
    "torch": torch.__version__,
    "python": sys.version.split()[0],
    "python_executable": sys.executable,
    "platform": platform.platform(),
    "cpus": os.cpu_count(),
    "compute_sanitizer": os.environ["GC_SAN"] or None,
    "ncu": os.environ["GC_NCU"] or None,
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "build": {"TORCH_CUDA_ARCH_LIST": os.environ["GC_ARCH"], "MAX_JOBS": os.environ["GC_JOBS"]},
    "steps_requested": sorted(os.environ["GC_STEPS"].split()),
}
with open(os.environ["GC_ENV_OUT"], "w") as f:
    json.dump(env, f, indent=1)
print(f"env: {env['device']}, driver {env['driver']}, CUDA {env['cuda_torch']}, torch {env['torch']}, "
      f"python {env['python']}, commit {env['git_commit'][:12]}")
EOF

# --- steps ------------------------------------------------------------------------
# Each step runs in its own bash (so that `timeout` can stop it with its children);
# these functions and variables travel there.
export REPO R PYTHON ARCH JOBS SANITIZER_ERROR_EXIT SANITIZER_BIN MODELS_DEADLINE_S
export SANITIZER_TESTS_LIST BENCH_EXTRA_LIST UNROLLS_LIST WAVES_LIST UNROLL_BENCH_ARGS_LIST

step_build() {
  set -euo pipefail
  cd "$REPO"
  echo "\$ $(build_cmd)"
  PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    TORCH_CUDA_ARCH_LIST=$ARCH MAX_JOBS=$JOBS "$PYTHON" -m pip install -v --no-build-isolation --no-deps -e .
  check_build
}

check_build() {
  "$PYTHON" - <<'EOF'
# gpu_check:build-check
import os, sys
import torch
import relu_ext
print("relu_ext imported from", relu_ext.__file__)
print("build_info:", relu_ext.build_info())
repo = os.path.realpath(os.environ["REPO"])
if not os.path.realpath(relu_ext.__file__).startswith(repo + os.sep):
    sys.exit(f"gpu_check: FAIL: python imports relu_ext from {relu_ext.__file__}, not from {repo}")
if not relu_ext.build_info()["cuda"]:
    sys.exit("gpu_check: FAIL: relu_ext was built WITHOUT its CUDA kernels (nvcc not found? torch without "
             "CUDA? see the build output above)")
x = torch.randn(1 << 20, device="cuda")
y = relu_ext.relu(x)
torch.cuda.synchronize()
if not torch.equal(y, torch.relu(x)):
    sys.exit("gpu_check: FAIL: relu_ext.relu on CUDA differs from torch.relu on randn data")
print("gpu_check: relu_ext has CUDA kernels for", relu_ext.build_info()["cuda_arch_list"], "and they run")
EOF
}

step_test() {
  set -euo pipefail
  cd "$REPO"
  echo "\$ $(test_cmd "$R")"
  "$PYTHON" -m pytest --full tests -q -ra -p no:cacheprovider --durations=15 --junitxml="$R/junit.xml"
}

step_sanitize() {  # tool
  set -uo pipefail
  cd "$REPO"
  local tool=$1 rc
  read -r -a tests <<<"$SANITIZER_TESTS_LIST"
  echo "==== compute-sanitizer --tool $tool ($(date -u +%FT%TZ))"
  echo "\$ $(sanitizer_cmd "$tool")"
  printf '    %s\n' "${tests[@]}"
  if [ -z "$SANITIZER_BIN" ]; then echo "gpu_check: FAIL: compute-sanitizer not found on PATH or in \$CUDA_HOME/bin"; return 1; fi
  # One pytest process: workers (-n in PYTEST_ADDOPTS, kept for the test step) under the sanitizer
  # ran past a 227 s limit on 2026-11-26 where one process takes 22 s.
  local -a env=(env -u PYTEST_ADDOPTS)
  [ "$tool" = memcheck ] && env+=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
  "${env[@]}" "$SANITIZER_BIN" --tool "$tool" --error-exitcode "$SANITIZER_ERROR_EXIT" --target-processes all \
    --report-api-errors no --print-limit 50 "$(command -v "$PYTHON")" -m pytest --full -q -p no:cacheprovider "${tests[@]}"
  rc=$?
  case $rc in
    0) echo "==== $tool: no errors, tests passed" ;;
    "$SANITIZER_ERROR_EXIT") echo "==== $tool: SANITIZER ERRORS (see above)" ;;
    *) echo "==== $tool: exit $rc: tests failed or did not run under the sanitizer (no sanitizer error reported)" ;;
  esac
  return $rc
}

step_bench() {
  set -euo pipefail
  cd "$REPO"
  read -r -a extra <<<"$BENCH_EXTRA_LIST"
  echo "\$ $(bench_cmd "$R")"
  "$PYTHON" -m relu_ext.bench --device cuda --out "$R" --name bench --no-progress "${extra[@]}"
  [ -s "$R/bench.json" ] || { echo "gpu_check: FAIL: no bench.json written"; return 1; }
}
step_unroll() {  # every variant even after a failed one
  set -uo pipefail
  cd "$REPO"
  local k w rc=0
  read -r -a args <<<"$UNROLL_BENCH_ARGS_LIST"
  for w in $WAVES_LIST; do
    for k in $UNROLLS_LIST; do
      echo "==== relu_ext's CUDA kernels with unroll $k, waves $w ($(date -u +%FT%TZ))"
      echo "\$ $(unroll_cmd "$k" "$w")"
      "$PYTHON" -m relu_ext.bench --device cuda --cuda-unroll "$k" --cuda-waves "$w" --what "$(unroll_what "$k")" \
        "${args[@]}" || { echo "==== unroll $k, waves $w: FAILED"; rc=1; }
    done
  done
  return $rc
}
step_models() {
  set -euo pipefail
  cd "$REPO"
  echo "\$ $(models_cmd "$R")"
  "$PYTHON" bench/gpu_models.py --device cuda --out "$R" --deadline "$MODELS_DEADLINE_S"
  [ -s "$R/gpu_models.json" ] || { echo "gpu_check: FAIL: no gpu_models.json written"; return 1; }
}
export -f step_build check_build step_test step_sanitize step_bench step_unroll step_models build_cmd test_cmd \
  sanitizer_cmd bench_cmd unroll_cmd unroll_what models_cmd

ROWS=()     # "name|result|seconds|log|note"
FAILED=0
record() { ROWS+=("$1|$2|$3|$4|$5"); case "$2" in PASS) ;; *) FAILED=1 ;; esac; }

# run_step NAME LOG NOTE-FUNCTION FUNCTION [ARGS...]: the step's output goes to LOG (appended).
run_step() {
  local name=$1 log=$2 note_fn=$3; shift 3
  local -a limit=()
  if [ "$DEADLINE" -gt 0 ]; then
    local left=$((DEADLINE - (SECONDS - T0) - RESERVE_S))
    if [ "$left" -lt 30 ]; then
      echo "---- $name: not started, ${left}s left before the deadline"
      record "$name" SKIPPED 0 "-" "deadline"
      LAST_RESULT=SKIPPED
      return 0
    fi
    limit=(timeout --kill-after=10 "$left")
  fi
  echo "---- $name ($(date +%H:%M:%S)) -> $(basename "$log")"
  local start=$SECONDS rc=0
  "${limit[@]}" bash -c "$(printf '%q ' "$@")" >>"$log" 2>&1 || rc=$?
  local took=$((SECONDS - start)) result=PASS
  [ $rc -eq 0 ] || result=FAIL
  if [ ${#limit[@]} -gt 0 ] && { [ $rc -eq 124 ] || [ $rc -eq 137 ]; }; then result=TIMEOUT; fi
  LAST_RESULT=$result
  local note
  note=$($note_fn "$log" "$rc" 2>/dev/null || true)
  [ "$result" = TIMEOUT ] && note="stopped at the deadline${note:+; $note}"
  record "$name" "$result" "$took" "${LOG_LABEL:-$(basename "$log")}" "$note"
  tail -n 12 "$log" | sed 's/^/    /'
  echo "---- $name: $result in ${took}s (exit $rc)"
  return 0
}

note_build() { grep -E "^gpu_check: (FAIL|relu_ext has)" "$1" | tail -n 1 | cut -c1-100; }
note_pytest() { grep -E "[0-9]+ (passed|failed|error)" "$1" | tail -n 1 | tr -d '=' | sed 's/^ *//' | cut -c1-100; }
note_sanitize() {  # from the last tool's section of the shared log only
  awk '/^==== compute-sanitizer --tool/ {sec = ""} {sec = sec $0 "\n"} END {printf "%s", sec}' "$1" \
    | grep -E "ERROR SUMMARY|^==== [a-z]+: " | sed -E 's/^=+ *//; s/^[a-z]+: //' | paste -sd';' - | cut -c1-100
}
note_bench() { [ -s "$R/bench.json" ] && echo "bench.json, bench.png; tables at the end of summary.txt" || echo "exit $2"; }
note_models() { [ -s "$R/gpu_models.json" ] && echo "gpu_models.json; table at the end of summary.txt" || echo "exit $2"; }
note_unroll() { echo "unroll ${UNROLLS[*]} x waves ${WAVES[*]}: tables at the end of summary.txt"; }

build_present() {
  "$PYTHON" -c '# gpu_check:has-build
import relu_ext, sys; sys.exit(0 if relu_ext.build_info()["cuda"] else 1)' >/dev/null 2>&1
}

BUILD_OK=1 LAST_RESULT=PASS
if [ -n "${WANT[build]:-}" ]; then
  : >"$R/build.log"
  run_step build "$R/build.log" note_build step_build
elif build_present; then
  echo "---- build: not asked for; relu_ext with CUDA kernels is already importable"
else
  echo "---- build: not asked for, but relu_ext with CUDA kernels cannot be imported (a fresh machine?): building"
  : >"$R/build.log"
  run_step build:auto "$R/build.log" note_build step_build
fi
[ "$LAST_RESULT" = PASS ] || BUILD_OK=0

skip_after_build() { record "$1" SKIPPED 0 "-" "build failed"; echo "---- $1: skipped (build failed)"; }

if [ -n "${WANT[test]:-}" ]; then
  if [ $BUILD_OK = 1 ]; then : >"$R/tests.log"; run_step test "$R/tests.log" note_pytest step_test
  else skip_after_build test; fi
fi
if [ -n "${WANT[sanitize]:-}" ]; then
  [ $BUILD_OK = 1 ] && : >"$R/sanitizer.log"
  for t in "${TOOLS[@]}"; do
    if [ $BUILD_OK = 1 ]; then run_step "sanitize:$t" "$R/sanitizer.log" note_sanitize step_sanitize "$t"
    else skip_after_build "sanitize:$t"; fi
  done
fi
if [ -n "${WANT[bench]:-}" ]; then
  if [ $BUILD_OK = 1 ]; then : >"$R/bench.log"; LOG_LABEL=summary.txt run_step bench "$R/bench.log" note_bench step_bench
  else skip_after_build bench; fi
fi
if [ -n "${WANT[unroll]:-}" ]; then
  if [ $BUILD_OK = 1 ]; then : >"$R/unroll.log"; LOG_LABEL=summary.txt run_step unroll "$R/unroll.log" note_unroll step_unroll
  else skip_after_build unroll; fi
fi
if [ -n "${WANT[models]:-}" ]; then
  if [ $BUILD_OK = 1 ]; then : >"$R/models.log"; LOG_LABEL=summary.txt run_step models "$R/models.log" note_models step_models
  else skip_after_build models; fi
fi

# --- summary ------------------------------------------------------------------------
{
  echo "relu_ext GPU check: $DEVICE_NAME, commit ${COMMIT:0:12}, $(date -u +%FT%TZ), ${#ROWS[@]} steps in $((SECONDS - T0))s"
  [ -s "$R/env.json" ] && echo "environment: env.json"
  printf '%-20s %-8s %7s  %-14s %s\n' step result seconds log note
  printf '%-20s %-8s %7s  %-14s %s\n' -------------------- -------- ------- -------------- ----
  for row in "${ROWS[@]}"; do
    IFS='|' read -r n res secs log note <<<"$row"
    printf '%-20s %-8s %7s  %-14s %s\n' "$n" "$res" "$secs" "$log" "$note"
  done
  if [ $FAILED = 0 ]; then echo "overall: PASS"; else echo "overall: FAIL"; fi
} >"$R/summary.txt"
if [ -f "$R/bench.log" ]; then  # the bench's tables, kept in the summary (one file fewer in $OUT)
  { echo; echo "==== bench output (python -m relu_ext.bench)"; cat "$R/bench.log"; } >>"$R/summary.txt"
  rm -f "$R/bench.log"
fi
if [ -f "$R/unroll.log" ]; then  # likewise
  { echo; echo "==== unroll and grid comparison (python -m relu_ext.bench --cuda-unroll K --cuda-waves W)"; cat "$R/unroll.log"; } >>"$R/summary.txt"
  rm -f "$R/unroll.log"
fi
if [ -f "$R/models.log" ]; then  # likewise
  { echo; echo "==== real models at GPU sizes (bench/gpu_models.py)"; cat "$R/models.log"; } >>"$R/summary.txt"
  rm -f "$R/models.log"
fi
echo
sed -n '1,/^overall:/p' "$R/summary.txt"
echo "files: $(cd "$R" && ls | tr '\n' ' ')"
exit $FAILED
