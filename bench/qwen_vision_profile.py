"""Where the Qwen vision stage's time goes, kernel by kernel, and what the memory profile's vision batch costs.

    python3 bench/qwen_vision_profile.py --family qwen2_5_vl [--size 1280x720] [--batch 8] [--out $OUT]

On a random-weight directory of the family's 7B/8B shape (written if missing, as the harness
does), it:
- times the stage the engine chooses on ``--batch`` photo-like images of ``--size`` (CUDA events,
  median), then runs it once under torch.profiler and sums the device time per kernel class
  (matrix products, attention, each Triton kernel, copies, the rest), beside the FLOP floor and
  the bytes the elementwise kernels must move;
- splits what ``ModelRunner.dummy_vision_batch`` does at start-up for the largest image a
  16,384-token prompt holds: making the random pixels on the host, the copy to the device, and
  the forward.
The last lines are two tables; the profiler's own table is written to $OUT.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from qwen_harness import CUDA, image_inputs, parse_size, timed, vision_flops

from fovea.testing import random_qwen2_5_vl, random_qwen3_vl

FAMILIES = {"qwen2_5_vl": (random_qwen2_5_vl, "qwen2.5-vl-7b"), "qwen3_vl": (random_qwen3_vl, "qwen3-vl-8b")}


def kernel_class(name: str) -> str:
    """A profiler event's kernel name, grouped."""
    lowered = name.lower()
    if any(key in lowered for key in ("gemm", "cutlass", "sm90_xmma", "cublas", "nvjet")):
        return "matrix products"
    if "flash" in lowered or "fmha" in lowered or "attention" in lowered:
        return "attention"
    if lowered.endswith("_kernel") or "triton" in lowered:
        return f"triton {name}"
    if "copy" in lowered or "memcpy" in lowered or "cat" in lowered or "index" in lowered or "gather" in lowered:
        return "copies and gathers"
    return "other"


def profile_stage(forward, images, out: Path) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with torch.inference_mode(), profile(activities=activities) as prof:
        forward(images)
        if CUDA:
            torch.cuda.synchronize()
    sort = "cuda_time_total" if CUDA else "cpu_time_total"
    (out / "qwen_vision_profile.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=60))
    classes: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if CUDA and device_us and not event.key.startswith("aten::"):
            classes[kernel_class(event.key)] += device_us / 1e3
    return dict(sorted(classes.items(), key=lambda kv: -kv[1]))


def startup_vision_batch(loaded, stage, max_model_len: int) -> dict[str, float]:
    """``dummy_vision_batch``'s parts for one largest image, in seconds."""
    adapter, codec = loaded.adapter, loaded.codec
    t0 = time.perf_counter()
    image = adapter.dummy_images(loaded.model.config, codec, 1, max_tokens=max_model_len - 1)[0]
    t1 = time.perf_counter()
    pixels = image.pixels.pin_memory().to(loaded.device, non_blocking=True) if CUDA else image.pixels
    if CUDA:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    on_device = type(image)(pixels, image.num_tokens, image.hash, image.grid)
    with torch.inference_mode():
        stage([on_device])
        if CUDA:
            torch.cuda.synchronize()
    t3 = time.perf_counter()
    with torch.inference_mode():
        stage([on_device])
        if CUDA:
            torch.cuda.synchronize()
    t4 = time.perf_counter()
    return {"patches": math.prod(image.grid), "host pixels s": t1 - t0, "to device s": t2 - t1,
            "first forward s": t3 - t2, "second forward s": t4 - t3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen2_5_vl")
    parser.add_argument("--arch", default=None, help="default: the family's 7B/8B shape (tiny: a CPU smoke run)")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--size", type=parse_size, default=(1280, 720))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    args = parser.parse_args()
    from fovea.engine.vision.vision_stage import choose_vision_stage
    from fovea.loading.loader import load_model

    writer, default_arch = FAMILIES[args.family]
    arch = args.arch or default_arch
    model_dir = args.model_dir or Path(f"/tmp/fovea-{arch}")
    if not (model_dir / "config.json").is_file():
        writer.write_model_dir(model_dir, arch, device="cuda" if CUDA else "cpu")
    loaded = load_model(model_dir, "cuda" if CUDA else "cpu", "bfloat16" if CUDA else "float32")
    stage = choose_vision_stage(loaded, enabled=True)
    images = image_inputs(loaded, args.size, args.batch, seed=5)
    seconds = timed(lambda: stage.forward(images), reps=10, warmup=2)
    flops = sum(vision_flops(loaded.model.config.vision_config, im.grid) for im in images)
    args.out.mkdir(parents=True, exist_ok=True)
    classes = profile_stage(stage.forward, images, args.out)
    split = startup_vision_batch(loaded, stage.forward, min(args.max_model_len, loaded.context_length))
    print(f"\n{stage.label}: {args.batch} x {args.size[0]}x{args.size[1]} ({math.prod(images[0].grid)} patches each)")
    print(f"{'wall, ms per image':<44}{1e3 * seconds / args.batch:>10.2f}")
    print(f"{'matrix TFLOP per image':<44}{flops / args.batch / 1e12:>10.2f}")
    for name, ms in classes.items():
        print(f"{'device ms per image: ' + name[:60]:<70}{ms / args.batch:>10.2f}")
    print("\nstart-up's vision batch (one largest image):")
    for key, value in split.items():
        print(f"  {key:<24}{value:>12.3f}" if isinstance(value, float) else f"  {key:<24}{value:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
