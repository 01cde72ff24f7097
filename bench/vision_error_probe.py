"""Probe: how far the fused vision stage's bf16 output is from transformers' modules, against
how far transformers' own output moves when only the batch size changes.

    python3 bench/vision_error_probe.py

Both differences come from rounding alone (other kernels, another summation order), so the
second is a yardstick for the first. On the random-weight LLaVA-7B of gpu_llava7b.py, at
336 px: 32 images through transformers' modules at batch 32 and one at a time, and through
the fused stage at batch 32. Prints relative L2 errors per image (median and worst).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_llava7b import build_model

from fovea.engine.vision.vision_fused import FusedVision, startup_problem
from fovea.models.clip_vision import encode_images


def rel(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Relative L2 error of each image's rows."""
    a, b = a.float(), b.float()
    return [float((x - y).norm() / y.norm()) for x, y in zip(a, b)]


def main() -> int:
    loaded = build_model(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(1)
    pixels = torch.randn(32, 3, 336, 336, device="cuda", dtype=torch.bfloat16, generator=gen)
    with torch.inference_mode():
        eager32 = encode_images(loaded, pixels)
        eager1 = torch.cat([encode_images(loaded, pixels[i:i + 1]) for i in range(32)])
        fused = FusedVision(loaded)
        print("start-up check:", startup_problem(loaded, fused) or "agrees")
        fused32 = fused(pixels)
        fused1 = torch.cat([fused(pixels[i:i + 1]) for i in range(32)])
    rows = [("transformers b1 vs transformers b32", rel(eager1, eager32)),
            ("fused b32 vs transformers b32", rel(fused32, eager32)),
            ("fused b1 vs transformers b1", rel(fused1, eager1))]
    print(f"{'comparison':40s}{'median':>10s}{'worst':>10s}")
    for name, errs in rows:
        print(f"{name:40s}{statistics.median(errs):10.2e}{max(errs):10.2e}")
    per_layer(loaded, fused, pixels[:4])
    return 0


def per_layer(loaded, fused: FusedVision, pixels: torch.Tensor) -> None:
    """Where the difference builds up: the residual stream after each layer, fused vs
    transformers' modules at batch 4, beside transformers at batch 1 vs batch 4."""
    from fovea.models.clip_vision import tower_hidden_states, vision_modules

    tower, _ = vision_modules(loaded)
    layers = list(range(len(fused.layers) + 1))
    with torch.inference_mode():
        eager4 = tower_hidden_states(tower, pixels, layers)
        eager1 = [torch.cat(states) for states in zip(*(tower_hidden_states(tower, pixels[i:i + 1], layers)
                                                         for i in range(pixels.shape[0])))]
        fused.indices = layers
        fused4 = fused.hidden_states(pixels)
    print(f"{'after layer':>12s}{'fused vs transformers':>24s}{'transformers b1 vs b4':>24s}")
    for i in layers:
        print(f"{i:12d}{statistics.median(rel(fused4[i], eager4[i])):24.2e}"
              f"{statistics.median(rel(eager1[i], eager4[i])):24.2e}")


if __name__ == "__main__":
    sys.exit(main())
