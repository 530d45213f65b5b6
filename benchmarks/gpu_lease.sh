#!/usr/bin/env bash
# The GPU benchmark in one command on a lent machine (docs/benchmarks/gpu.md):
#
#   bash benchmarks/gpu_lease.sh [--smoke] [--shape sd35m|flux1dev|qwen_image] [--budget S]
#                                [--skip-quick] [-- BENCH_GPU_ARGS...]
#
# 1. $OUT/env.txt first: GPU, driver, packages, attention kernels, TF32.
# 2. The wheels in .whl/ (`make gpu-wheels`, carried with the call) installed into a
#    temporary folder put on PYTHONPATH with the repo: the machine has no network.
# 3. A fail-fast --quick pass at the real shape ($OUT/quick.log); it stops here on failure.
#    --skip-quick leaves it out: for a second call at a commit whose quick pass has passed.
# 4. The measurement, finished within S seconds of the start (default 480), torchrun check
#    last ($OUT/bench.log, results JSON and markdown rewritten as it goes).
# --smoke runs the same path on a CPU with the shape's tiny twin (tests/test_bench_gpu.py).
# PYTHON (default python3) runs it all; WHEELS (default .whl) holds the wheels: none there,
# none installed. OUT defaults to results/gpu_lease.
set -euo pipefail
shopt -s nullglob

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-$REPO/.whl}
OUT=${OUT:-$REPO/results/gpu_lease}
MAX_FILES=8          # what a lease returns from $OUT
QUICK_TIMEOUT=240    # the quick pass takes under a minute; a hang must not eat the lease
DDP_TIMEOUT=120      # the torchrun check: a model build and two epochs
STARTUP_MARGIN=20    # the measurement's interpreter start and imports, outside its clock
MIN_MEASURE=60       # less left than this for the measurement: not worth starting
HARD_GRACE=60        # beyond its budget before the measurement is killed

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
fail() { echo "gpu_lease: $*" >&2; exit 1; }

# One "label: value" line; a failing command gives its exit status and output instead.
fact() {
  local label=$1 value
  shift
  if value=$("$@" 2>&1); then :; else value="unavailable (exit $?): $value"; fi
  printf '%s: %s\n' "$label" "$(printf '%s' "$value" | tr '\n' ';' | head -c 400)"
}

small_twin() {
  case "$1" in
    sd35m) echo small ;;
    *) echo "$1_small" ;;
  esac
}

write_env_header() {
  {
    if ((SMOKE)); then
      echo "# gpu_lease.sh: CPU smoke run, not a result"
    else
      echo "# gpu_lease.sh: GPU lease"
    fi
    fact date date -u +%Y-%m-%dT%H:%M:%SZ
    echo "arguments: ${ARGUMENTS:-none}"
    echo "shape: $SHAPE (runs --shape $RUN_SHAPE); budget: $BUDGET s"
    fact host uname -srm
    fact git git -C "$REPO" rev-parse --short HEAD
    fact nvidia-smi nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit \
      --format=csv,noheader
  } >"$ENV_FILE"
}

# Carried wheels into a temporary target, ahead of the image's packages on PYTHONPATH.
install_wheels() {
  local wheels=()
  if [[ -d $WHEELS ]]; then
    wheels=("$WHEELS"/*.whl)
  fi
  export PYTHONPATH="$REPO:$REPO/diffusion${PYTHONPATH:+:$PYTHONPATH}"
  if ((${#wheels[@]} == 0)); then
    echo "wheels: none in $WHEELS, nothing installed: $PYTHON's own packages are used" >>"$ENV_FILE"
    return
  fi
  if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}" >"$SITE.log" 2>&1; then
    fact "wheels: install FAILED" tail -n 5 "$SITE.log" >>"$ENV_FILE"
    fail "installing the ${#wheels[@]} carried wheels failed: $(tail -n 1 "$SITE.log")"
  fi
  echo "wheels: installed ${#wheels[@]} from $WHEELS into $SITE" >>"$ENV_FILE"
  export PYTHONPATH="$SITE:$PYTHONPATH"
}

# The quick pass's exit status and last log line, as the one line a failure ends with.
explain() {
  local status=$1 log=$2
  if ((status == 124 || status == 137)); then
    echo "timed out (exit $status)"
  else
    echo "exit $status: $(tail -n 1 "$log")"
  fi
}

SMOKE=0
SKIP_QUICK=0
SHAPE=sd35m
BUDGET=480
ARGUMENTS="$*"
bench_args=()
while (($#)); do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --skip-quick) SKIP_QUICK=1 ;;
    --shape) SHAPE=${2:?--shape needs a value}; shift ;;
    --shape=*) SHAPE=${1#*=} ;;
    --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
    --budget=*) BUDGET=${1#*=} ;;
    -h | --help) usage; exit 0 ;;
    --) shift; bench_args=("$@"); break ;;
    *) fail "unknown argument $1 (see --help)" ;;
  esac
  shift
done
case "$SHAPE" in
  sd35m | flux1dev | qwen_image) ;;
  *) fail "--shape must be sd35m, flux1dev or qwen_image, not $SHAPE" ;;
esac
[[ $BUDGET =~ ^[0-9]+$ ]] || fail "--budget takes whole seconds, not $BUDGET"

RUN_SHAPE=$SHAPE
device_args=()
size_args=()
if ((SMOKE)); then
  RUN_SHAPE=$(small_twin "$SHAPE")
  device_args=(--device cpu)
  # Two rounds: the amortized rows get a solve and a cached step, as on the GPU.
  size_args=(--rounds 2 --repeats 1 --checkpointing on --batch 2 --train-sampling-steps 2)
fi

cd "$REPO"
mkdir -p "$OUT"
ENV_FILE=$OUT/env.txt
SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu_lease_site.XXXXXX")
QUICK_DIR=$(mktemp -d "${TMPDIR:-/tmp}/gpu_lease_quick.XXXXXX")
trap 'rm -rf "$SITE" "$SITE.log" "$QUICK_DIR"' EXIT
export PYTHONUNBUFFERED=1

write_env_header
install_wheels
"$PYTHON" benchmarks/gpu_lease.py env --wheels "$WHEELS" >>"$ENV_FILE" 2>&1 ||
  echo "environment report: FAILED (exit $?)" >>"$ENV_FILE"
echo "gpu_lease: wrote $ENV_FILE"

status=0
if ((SKIP_QUICK)); then
  echo "quick pass: skipped (--skip-quick)" >>"$ENV_FILE"
else
  echo "gpu_lease: quick pass of --shape $RUN_SHAPE"
  timeout --kill-after=10 "$QUICK_TIMEOUT" "$PYTHON" benchmarks/bench_gpu.py \
    --shape "$RUN_SHAPE" "${device_args[@]}" --quick --strict --out "$QUICK_DIR" \
    >"$OUT/quick.log" 2>&1 || status=$?
  ((status == 0)) || fail "quick pass FAILED, $(explain "$status" "$OUT/quick.log") (log: $OUT/quick.log)"
fi

remaining=$((BUDGET - SECONDS - STARTUP_MARGIN))
((remaining >= MIN_MEASURE)) ||
  fail "only ${remaining} s of the ${BUDGET} s budget left after the quick pass: not measuring"
echo "gpu_lease: ready in ${SECONDS} s; measuring for at most ${remaining} s"
timeout --kill-after=10 "$((remaining + HARD_GRACE))" "$PYTHON" benchmarks/bench_gpu.py \
  --shape "$RUN_SHAPE" "${device_args[@]}" "${size_args[@]}" --budget "$remaining" \
  --ddp-timeout "$DDP_TIMEOUT" --out "$OUT" "${bench_args[@]}" >"$OUT/bench.log" 2>&1 ||
  status=$?
grep -E '^(stopped early|FAILED)' "$OUT/bench.log" || true

files=$(find "$OUT" -type f | wc -l)
((files <= MAX_FILES)) || fail "$files files under $OUT: a lease returns at most $MAX_FILES"
((status == 0)) || fail "measurement FAILED, $(explain "$status" "$OUT/bench.log"); what it wrote is under $OUT"
echo "gpu_lease: done in ${SECONDS} s; $files files under $OUT: $(find "$OUT" -type f -printf '%P ')"
