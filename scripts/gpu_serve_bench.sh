#!/usr/bin/env bash
# On a lent H200: install the carried web wheels, run the engine checks, then the end-to-end
# serving benchmark (bench/gpu_serve.py) with the flags given.
# Usage (device tool, carry [".whl"]): bash scripts/gpu_serve_bench.sh [--no-checks] [gpu_serve.py flags...]
# The wheels (fastapi, starlette, pydantic, pydantic-core, typing-inspection, annotated-types, uvicorn,
# python-multipart, opentelemetry-api, annotated-doc) are fetched here as scripts/gpu_http_bench.sh says.
set -euo pipefail
OUT=${OUT:-/tmp/fovea-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
status=0
if [ "${1:-}" = "--no-checks" ]; then
  shift
else
  bash scripts/gpu_engine_checks.sh --checks-only || status=1
fi
python3 bench/gpu_serve.py --out "$OUT" "$@" 2>&1 | grep --line-buffered -v "Loading weights" | tee "$OUT/serve.log" \
  || status=1
exit $status
