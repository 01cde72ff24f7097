#!/usr/bin/env bash
# On a lent H200: what HTTP costs on the GPU. Serves the demo model with `fovea serve` on
# CUDA and loads it with bench/http_load.py (single requests, then concurrent clients), after
# the same scenes through the engines offline (bench/offline_demo.py), so the difference is HTTP.
#
# The GPU machine has no fastapi/uvicorn/pydantic: carry them as wheels (git-ignored .whl/).
# Fetch them here first (Python 3.12 wheels, the versions this checkout was tested with):
#   for p in fastapi starlette pydantic pydantic-core typing-inspection annotated-types \
#            uvicorn python-multipart typing-extensions opentelemetry-api; do
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl "$p==$(pip show $p | awk '/^Version/{print $2}')"
#   done
# Then (device tool): run with carry [".whl"]:  bash scripts/gpu_http_bench.sh
set -uo pipefail
OUT=${OUT:-/tmp/fovea-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1
echo "== offline, demo model on cuda, bfloat16"
timeout 240 python3 bench/offline_demo.py --device cuda --dtype bfloat16 --requests 96 --batch 16 2>&1 \
  | grep -v "Loading weights" | tee "$OUT/offline_demo.log"
for engine in paged; do
  echo "== HTTP, demo model on cuda, bfloat16, $engine engine"
  timeout 240 python3 bench/http_load.py --device cuda --dtype bfloat16 --engine "$engine" --max-batch-size 16 \
    --single 40 --concurrency 16 --requests 96 --json "$OUT/http_$engine.json" 2>&1 | tee "$OUT/http_$engine.log"
done
