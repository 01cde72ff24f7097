#!/usr/bin/env bash
# Train fovea-shapes on a lent GPU and send the model directory back through $OUT.
# Usage (device tool): bash scripts/train_demo_on_gpu.sh [extra train flags...]
set -euo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fovea-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
python3 -m fovea.demo.train --out /tmp/fovea-shapes "$@" 2>&1 | grep -v "Writing model shards" | tee "$OUT/train.log"
# model.safetensors is larger than one returned file may be: ship the directory in parts.
tar -C /tmp -czf - fovea-shapes | split -b 15M - "$OUT/fovea-shapes.tgz.part-"
ls -la "$OUT"
