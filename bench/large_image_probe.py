"""Large images beside small requests: the server's resident memory and the small requests' latency.

    python bench/large_image_probe.py [--large 8] [--small 16]

Starts `fovea serve` on the demo model (CPU) twice: once with the large-image lane and the
reduction before the processor switched off (``--exact-image-resize --decode-memory 1TiB``),
once with the defaults. Each time it sends ``--large`` requests at once,
each with one small PNG of 39.7 megapixels (a flat canvas compresses to about 130 KiB), and
meanwhile ``--small`` ordinary scene requests one after another. It prints the server's peak
resident memory above its idle level, and the small requests' latency, for both settings.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_serve import Server  # noqa: E402

from fovea.demo import scenes  # noqa: E402


def big_png(width: int = 7296, height: int = 5440) -> bytes:  # 39.7 megapixels
    image = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 4, height // 4, width // 2, height // 2), fill=(220, 30, 30))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def body(url: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "Describe the image."}]}],
            "max_tokens": 16, "temperature": 0}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def watch_rss(pid: int, stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], rss_bytes(pid))
        time.sleep(0.02)


async def load(url: str, large: list[dict], small: list[dict]) -> tuple[list[float], float, list[int]]:
    async with httpx.AsyncClient(timeout=600) as client:
        big = [asyncio.create_task(client.post(url + "/v1/chat/completions", json=b)) for b in large]
        await asyncio.sleep(0.3)  # the large decodes are under way
        latencies = []
        for b in small:
            t = time.perf_counter()
            reply = await client.post(url + "/v1/chat/completions", json=b)
            assert reply.status_code == 200, reply.text[:200]
            latencies.append(time.perf_counter() - t)
        t = time.perf_counter()
        statuses = [r.status_code for r in await asyncio.gather(*big)]
        return latencies, time.perf_counter() - t, statuses


def run(name: str, extra: list[str], large: list[dict], small: list[dict], out: Path) -> dict:
    server = Server(None, out, name, *extra, device="cpu")
    try:
        server.wait_ready()
        idle = rss_bytes(server.proc.pid)
        stop, peak = threading.Event(), [idle]
        watcher = threading.Thread(target=watch_rss, args=(server.proc.pid, stop, peak), daemon=True)
        watcher.start()
        latencies, rest, statuses = asyncio.run(load(server.url, large, small))
        stop.set()
        watcher.join()
    finally:
        server.stop()
    return {"name": name, "rss_rise_gib": (peak[0] - idle) / 2**30, "small_p50_s": statistics.median(latencies),
            "small_max_s": max(latencies), "large_statuses": sorted(set(statuses))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--large", type=int, default=8)
    parser.add_argument("--small", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/fovea-large-probe")))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = big_png()
    print(f"large PNG: {len(data) / 1024:.0f} KiB, 39.7 megapixels", flush=True)
    large = [body("data:image/png;base64," + base64.b64encode(data).decode()) for _ in range(args.large)]
    rng = random.Random(5)
    small = []
    for _ in range(args.small):
        buffer = io.BytesIO()
        scenes.render(scenes.SceneSampler().sample(rng)).save(buffer, format="PNG")
        small.append(body("data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()))
    rows = [run("unbounded", ["--exact-image-resize", "--decode-memory", "1TiB"], large, small, args.out),
            run("default", [], large, small, args.out)]
    for r in rows:
        print(f"{r['name']:<10} RSS rise {r['rss_rise_gib']:.2f} GiB, small requests p50 {r['small_p50_s']:.2f} s, "
              f"max {r['small_max_s']:.2f} s, large answered {r['large_statuses']}")
    return 0 if all(r["large_statuses"] == [200] for r in rows) else 1  # a refused large image is a failure


if __name__ == "__main__":
    sys.exit(main())
