#!/usr/bin/env bash
# On a lent H200: check the paged engine's GPU-only parts, then run the LLaVA-7B benchmark.
# Usage (device tool): bash scripts/gpu_engine_checks.sh [--checks-only | bench flags...]
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fovea-out}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "== triton decode kernel vs torch reference"
  timeout 120 python3 -m fovea.engine.paged.triton_decode --check
  echo "== triton prefill kernel vs torch reference"
  timeout 120 python3 -m fovea.engine.paged.triton_prefill --check
  echo "== fused norm / rotary / activation / matrix-vector kernels vs torch"
  timeout 120 python3 -m fovea.engine.paged.triton_ops --check
  echo "== end-to-end self-check vs transformers generate (demo model, fp32)"
  timeout 120 python3 -m fovea.engine.paged.selfcheck --device cuda
  echo "== same, prefill chunks of 24 tokens"
  timeout 120 python3 -m fovea.engine.paged.selfcheck --device cuda --chunk 24
  echo "== same, bfloat16"
  timeout 120 python3 -m fovea.engine.paged.selfcheck --device cuda --dtype bfloat16
} 2>&1 | grep -v "Loading weights" | tee "$OUT/checks.log"
[ "${1:-}" = "--checks-only" ] && exit 0
echo "== LLaVA-1.5-7B architecture benchmark"
python3 bench/gpu_llava7b.py --out "$OUT" "$@" 2>&1 | grep -v "Loading weights" | tee "$OUT/bench.log"
