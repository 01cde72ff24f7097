"""The E/PD pool's writing of a batch's pixels into shared memory, beside a thread that holds
the GIL in long C calls (as a serving process's response encoding, tokenizers and pydantic do).

    python3 bench/handoff_write_probe.py [--images 21] [--reps 9] [--holder-rows 20000]

Two ways, each alone and beside the holder, median ms per batch:
- ``torch calls``: what the pool did before host_copy.py: per image ``detach``, ``to``,
  ``contiguous``, two ``view``s and a ``copy_`` into the segment, each releasing the GIL and
  waiting to retake it;
- ``now``: ``encode_worker.image_item`` and ``wire.encode``, a GIL-keeping memmove per image.
The images are LLaVA-sized bf16 pixels (3 x 336 x 336). CPU only; no GPU is involved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gil_releasing_calls import GilHolder

from fovea.disagg import encode_worker, wire
from fovea.disagg.shared_segment import OwnedSegment, aligned
from fovea.models.base import ImageInput


def with_torch_calls(images: list[ImageInput], segment) -> None:
    offset = 0
    for image in images:
        data = image.pixels.detach().to("cpu").contiguous()
        flat = data.contiguous().view(-1).view(torch.uint8)
        segment.view(offset, flat.numel()).copy_(flat)
        offset += aligned(flat.numel())


def now(images: list[ImageInput], segment) -> None:
    items = [({"kind": "batch"}, None), *(encode_worker.image_item("b", image, "r") for image in images)]
    wire.encode(items, segment)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=21, help="a batch (21: the mean batch serving 256 requests)")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--holder-rows", type=int, default=20_000, help="the holder's json.dumps size")
    args = parser.parse_args()
    images = [ImageInput(torch.randn(3, 336, 336).to(torch.bfloat16), 576, f"h{i}", None) for i in range(args.images)]
    owned = OwnedSegment(False)
    segment = owned.ensure(sum(aligned(i.pixels.numel() * 2) for i in images))
    holder = GilHolder(args.holder_rows)

    def median_ms(fn) -> float:
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn(images, segment)
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)

    rows = {name: [median_ms(fn)] for name, fn in (("torch calls", with_torch_calls), ("now", now))}
    try:
        with holder:
            for name, fn in (("torch calls", with_torch_calls), ("now", now)):
                rows[name].append(median_ms(fn))
    finally:
        owned.close()
    print(f"{args.images} images of 3 x 336 x 336 bf16; the holder's json.dumps holds the GIL {holder.hold_ms:.1f} ms\n")
    print("| way | alone, ms per batch | beside the holder, ms per batch |\n|---|---|---|")
    for name, (alone, beside) in rows.items():
        print(f"| {name} | {alone:.2f} | {beside:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
