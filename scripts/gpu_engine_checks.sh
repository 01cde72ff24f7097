#!/usr/bin/env bash
# On a lent H200: check the paged engine's GPU-only parts, then run the LLaVA-7B benchmark.
# Usage (device tool): bash scripts/gpu_engine_checks.sh [--checks-only | bench flags...]
# Exits non-zero when any check fails (each check still runs, so one run shows every failure).
set -euo pipefail
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fovea-out}
mkdir -p "$OUT"
LOG="$OUT/checks.log"
: >"$LOG"
failed=()

check() {  # check NAME COMMAND...: run it, log it, remember a failure
  local name=$1
  shift
  echo "== $name" | tee -a "$LOG"
  if timeout 180 "$@" > >(grep -v "Loading weights" | tee -a "$LOG") 2>&1; then
    echo "-- ok: $name" | tee -a "$LOG"
  else
    echo "-- FAILED (exit $?): $name" | tee -a "$LOG"
    failed+=("$name")
  fi
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$LOG"
check "triton decode kernel vs torch reference" python3 bench/kernels_check.py --kernel decode --check
check "triton prefill kernel vs torch reference" python3 bench/kernels_check.py --kernel prefill --check
check "fused norm / rotary / activation / matrix-vector kernels vs torch" python3 bench/kernels_check.py --kernel ops --check
check "fused vision stage kernels and stage vs transformers' modules" python3 bench/kernels_check.py --kernel vision --check
check "end-to-end self-check vs transformers generate (demo model, fp32)" \
  python3 bench/paged_selfcheck.py --device cuda
check "same, prefill chunks of 24 tokens" python3 bench/paged_selfcheck.py --device cuda --chunk 24
check "same, bfloat16" python3 bench/paged_selfcheck.py --device cuda --dtype bfloat16
check "GPU tests (memory plan held, out-of-memory recovery)" python3 -m pytest -q -p no:cacheprovider tests/gpu

if ((${#failed[@]})); then
  echo "FAILED checks: ${failed[*]}" | tee -a "$LOG"
  exit 1
fi
echo "all checks passed" | tee -a "$LOG"
[ "${1:-}" = "--checks-only" ] && exit 0
echo "== LLaVA-1.5-7B architecture benchmark"
python3 bench/gpu_llava7b.py --out "$OUT" "$@" 2>&1 | grep -v "Loading weights" | tee "$OUT/bench.log"
