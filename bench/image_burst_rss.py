"""The server's resident memory after each of several identical bursts of large images.

    python bench/image_burst_rss.py [--images 8] [--rounds 3] [--side 6300] [-- extra serve flags]

Starts `fovea serve` on the demo model (CPU), then sends ``--rounds`` bursts, each of ``--images``
concurrent requests with one ``--side`` x ``--side`` PNG (6300: 39.7 megapixels; a flat canvas
with one disc compresses to a few hundred KiB). After each burst it waits for the server to go
quiet and prints its resident memory (VmRSS). Memory that a server keeps for reuse levels off by
the second burst; memory that grows from burst to burst does not.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_serve import Server  # noqa: E402
from large_image_probe import rss_bytes  # noqa: E402

from fovea.testing.images import flat_png  # noqa: E402

SETTLE_S = 2.0


def body(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "Describe the image."}]}],
            "max_tokens": 4, "temperature": 0}


async def burst(url: str, bodies: list[dict]) -> list[int]:
    async with httpx.AsyncClient(timeout=600) as client:
        replies = await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=b) for b in bodies))
    return [r.status_code for r in replies]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", type=int, default=6300)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/fovea-burst-rss")))
    parser.add_argument("serve_flags", nargs="*", help="after --: more `fovea serve` flags")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = flat_png(args.side)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    print(f"PNG {args.side}x{args.side} ({args.side ** 2 / 1e6:.1f} Mpx, {len(data) / 1024:.0f} KiB), "
          f"{args.images} at once, {args.rounds} rounds; serve flags {args.serve_flags}", flush=True)
    server = Server(None, args.out, "burst", *args.serve_flags, device="cpu")
    try:
        server.wait_ready()
        print(f"idle      RSS {rss_bytes(server.proc.pid) / 2**20:,.0f} MiB", flush=True)
        for round_ in range(1, args.rounds + 1):
            started = time.perf_counter()
            statuses = asyncio.run(burst(server.url, [body(url)] * args.images))
            seconds = time.perf_counter() - started
            time.sleep(SETTLE_S)
            print(f"round {round_}   RSS {rss_bytes(server.proc.pid) / 2**20:,.0f} MiB  ({seconds:.1f} s, "
                  f"statuses {sorted(set(statuses))})", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
