"""On two GPUs: e_pd with the encode worker on one GPU and the prefill/decode worker on the other
(both ways round) answers as agg does, token for token (the demo model in bf16).

Skipped with fewer than two CUDA GPUs (CI has none; issue 16's machine kind has two). Each server
is its own `fovea serve` process: an engine caps its process's allocator at its memory plan, so
servers on one GPU cannot share a process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from scene_helpers import data_url, free_port, fresh_scene

from fovea.demo import scenes

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
SRC = Path(__file__).resolve().parents[2] / "src"


def serve_answers(*flags: str) -> tuple[list[str], dict]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{SRC}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "fovea.cli", "serve", "--port", str(port), "--dtype", "bfloat16",
                             "--no-canary", "--gpu-memory-utilization", "0.5", *flags], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start in 300 s"
            time.sleep(0.5)
        answers = []
        for seed in range(6):
            image = scenes.render(fresh_scene(500 + seed))
            reply = httpx.post(base + "/v1/chat/completions", timeout=120, json={
                "max_tokens": 40, "temperature": 0, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": data_url(image)}},
                    {"type": "text", "text": "Describe the image."}]}]})
            assert reply.status_code == 200, reply.text
            answers.append(reply.json()["choices"][0]["message"]["content"])
        return answers, httpx.get(base + "/health", timeout=30).json()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("pd,encode", [("cuda:0", "cuda:1"), ("cuda:1", "cuda:0")])
def test_e_pd_across_two_gpus_answers_as_agg(pd, encode):
    reference, _ = serve_answers("--device", pd)
    answers, health = serve_answers("--device", pd, "--topology", "e_pd", "--encode-device", encode)
    assert health["encode_workers"][0]["plan"]["device"] == encode
    assert answers == reference
