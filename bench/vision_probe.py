"""Probe: where the LLaVA-7B vision stage's time goes at batch 32, and what compiling buys.

    python3 bench/vision_probe.py

Times transformers' CLIP tower + projector as fovea calls it, the same with the layers past
the feature layer dropped, and that under torch.compile; then the GEMMs alone (the part
that can reach the matrix rate). Prints one table; each figure is a median of CUDA-event
timings.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_llava7b import build_model, ceilings, time_cuda, vision_flops_per_image

from fovea.models.clip_vision import encode_images


def main() -> int:
    c = ceilings()
    loaded = build_model(torch.device("cuda"))
    pixels = torch.randn(32, 3, 336, 336, device="cuda", dtype=torch.bfloat16)
    floor = 32 * vision_flops_per_image(loaded) / c["bf16_matmul_flops"]
    rows = []
    with torch.inference_mode():
        rows.append(("encode_images (fovea today)", time_cuda(lambda: encode_images(loaded, pixels), reps=10)))
        tower = loaded.model.model.vision_tower
        projector = loaded.model.model.multi_modal_projector
        layers = tower.encoder.layers
        keep = len(layers) - 1  # feature layer -2: the last layer's output is never used

        def truncated():
            h = tower.pre_layrnorm(tower.embeddings(pixels))
            for layer in layers[:keep]:
                h = layer(h, None)
                h = h[0] if isinstance(h, tuple) else h
            return projector(h[:, 1:])

        rows.append(("dropped unused last layer", time_cuda(truncated, reps=10)))
        t = time.time()
        compiled = torch.compile(truncated)
        compiled()
        torch.cuda.synchronize()
        print(f"compile took {time.time() - t:.1f} s", flush=True)
        rows.append(("  + torch.compile", time_cuda(compiled, reps=10)))
        # The matrix products alone, batch 32 x 577 tokens.
        m = 32 * 577
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        w_qkv = torch.randn(3072, 1024, device="cuda", dtype=torch.bfloat16)
        w_o = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
        w_fc1 = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
        w_fc2 = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        lin = torch.nn.functional.linear

        def gemms():
            for _ in range(keep):
                lin(x, w_qkv)
                lin(x, w_o)
                lin(x, w_fc1)
                lin(h, w_fc2)

        rows.append(("GEMMs only (23 layers)", time_cuda(gemms, reps=5)))
    print(f"\nceilings: {c['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s; FLOPs floor b32 {1e3 * floor:.1f} ms "
          f"({32 / floor:.0f} images/s)")
    print(f"{'variant':34s}{'ms':>8s}{'images/s':>10s}{'of floor':>10s}")
    for name, s in rows:
        print(f"{name:34s}{1e3 * s:8.2f}{32 / s:10.0f}{floor / s:10.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
