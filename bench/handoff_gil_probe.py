"""Why is the E/PD landing 15x slower under load than idle? A probe of the GIL hypothesis.

    python3 bench/handoff_gil_probe.py [--images 32] [--reps 7]

Lands --images LLaVA-sized payloads (576 x 4096 bf16 rows, back to back in pinned host memory,
as the pool's shared segment gives them) with ``handoff.land_each`` image by image
(``batched=False``: a copy and seven checksum calls per image) and batched (one copy of the
block, one checksum kernel, the rows as views: a fixed number of torch calls), each timed:
- alone;
- beside a thread that runs pure Python (holding the GIL between bytecodes, as the engine
  thread and the event loop do while serving), at the default 5 ms switch interval and at 0.5 ms.
Every torch call releases and retakes the GIL; with a busy neighbour, retaking it can wait for
a whole switch interval. Prints a table of ms per image (median of --reps).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fovea.disagg import handoff


def payloads(n: int, rows: int, hidden: int) -> list[tuple[handoff.EmbeddingHeader, torch.Tensor]]:
    out = []
    segment = torch.empty(n * rows * hidden * 2, dtype=torch.uint8).pin_memory()
    for i in range(n):
        rows_t = torch.randn(rows, hidden, dtype=torch.bfloat16)
        view = segment[i * rows * hidden * 2:(i + 1) * rows * hidden * 2]
        view.copy_(rows_t.view(-1).view(torch.uint8))
        header = handoff.EmbeddingHeader(
            dtype="bfloat16", shape=(rows, hidden), tokens=rows, checksum=int(handoff.checksum(rows_t)),
            request_id="r", image_hash=f"h{i}", model_id="m", vision_fingerprint="v", recipe_fingerprint="p",
            grid=None)
        out.append((header, view))
    return out


def busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def time_landing(fn, items, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(items, "cuda")
        assert all(isinstance(o, torch.Tensor) for o in out), out
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / len(items))
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    items = payloads(args.images, 576, 4096)
    variants = {"per image (land_each, one checksum per image)": lambda it, d: handoff.land_each(it, d, batched=False),
                "batched (one copy, one checksum kernel per batch)": lambda it, d: handoff.land_each(it, d, batched=True)}
    for name, fn in variants.items():
        fn(items, "cuda")  # warm-up (and the kernel's compilation)
        print(f"{name}: warmed up", flush=True)
    rows = []
    for name, fn in variants.items():
        alone = time_landing(fn, items, args.reps)
        loaded = {}
        for interval in (0.005, 0.0005):
            sys.setswitchinterval(interval)
            stop = threading.Event()
            neighbours = [threading.Thread(target=busy, args=(stop,)) for _ in range(2)]
            for t in neighbours:
                t.start()
            try:
                loaded[interval] = time_landing(fn, items, args.reps)
            finally:
                stop.set()
                for t in neighbours:
                    t.join()
            sys.setswitchinterval(0.005)
        rows.append((name, alone, loaded[0.005], loaded[0.0005]))
        print(f"{name}: alone {1e3 * alone:.3f}, busy 5 ms {1e3 * loaded[0.005]:.3f}, busy 0.5 ms "
              f"{1e3 * loaded[0.0005]:.3f} ms per image", flush=True)
    print(f"\n{args.images} images of 576 x 4096 bf16 (4.7 MB), ms per image, median of {args.reps}")
    print("| landing | alone | 2 busy Python threads, 5 ms switch | same, 0.5 ms switch |")
    print("|---|---|---|---|")
    for name, a, b, c in rows:
        print(f"| {name} | {1e3 * a:.3f} | {1e3 * b:.3f} | {1e3 * c:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
