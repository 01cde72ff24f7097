"""Bursts of large images, repeated, leave the server's resident memory where it was.

The adversarial probe sent the same burst of eight 39.7-megapixel PNGs three times and saw the
server grow after each (1.81, 1.90, 2.16 GB): freed decode buffers stayed in glibc's per-thread
heaps. Here a CI-sized burst (eight 16-megapixel PNGs) goes to a `fovea serve` process of its own,
three times, and its VmRSS after each burst must stay within one decoded image's bytes of its
level after a warm-up burst of ordinary images (bench/image_burst_rss.py measures the full size).
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from process_helpers import stop_process
from scene_helpers import data_url, free_port, fresh_scene

import fovea
from fovea.demo import scenes
from fovea.media import heap
from fovea.testing.images import flat_png

SIDE = 4000  # 16 megapixels: over the large-image threshold (4 Mpx), decoded at full size then reduced
IMAGES = 8
DECODED_BYTES = SIDE * SIDE * 4  # PIL holds an RGB image at 4 bytes a pixel

pytestmark = pytest.mark.skipif(not heap.release_free_memory(), reason="returning freed memory needs glibc")


def chat(url: str) -> dict:
    return {"max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe the image."}]}]}


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port, log = free_port(), tmp_path_factory.mktemp("burst") / "server.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(fovea.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "fovea.cli", "--log-level", "warning", "serve", "--device",
                                    "cpu", "--dtype", "float32", "--no-canary", "--port", str(port)],
                                   env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text(errors="replace")
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server was not ready within 120 s"
            time.sleep(0.2)
        yield base, process.pid
    finally:
        stop_process(process, grace_s=30)


async def burst(base: str, bodies: list[dict]) -> list[int]:
    async with httpx.AsyncClient(timeout=300) as client:
        return [r.status_code for r in
                await asyncio.gather(*(client.post(base + "/v1/chat/completions", json=b) for b in bodies))]


def test_repeated_bursts_of_large_images_leave_the_server_no_larger(server):
    base, pid = server
    # A warm-up burst of ordinary images: the decode threads and every first-use cache exist after it.
    ordinary = [chat(data_url(scenes.render(fresh_scene(84_000 + i)))) for i in range(IMAGES)]
    assert asyncio.run(burst(base, ordinary)) == [200] * IMAGES
    before = rss(pid)
    large = chat("data:image/png;base64," + base64.b64encode(flat_png(SIDE)).decode())
    growth = []
    for _ in range(3):
        assert asyncio.run(burst(base, [large] * IMAGES)) == [200] * IMAGES
        growth.append(rss(pid) - before)
    assert max(growth) < DECODED_BYTES, (f"resident memory after each burst, above its level before them: "
                                         f"{[round(g / 2**20) for g in growth]} MiB; one decoded image is "
                                         f"{DECODED_BYTES / 2**20:.0f} MiB")
