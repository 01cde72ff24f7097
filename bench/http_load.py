"""HTTP load generator for fovea (or any OpenAI-compatible server) with drawn-scene images.

    python bench/http_load.py                       # starts `fovea serve` on the demo model itself
    python bench/http_load.py --url http://127.0.0.1:8000 --concurrency 8 --requests 64

Every request streams (SSE), so each one yields its time to first token (TTFT), time per
output token after the first (TPOT) and end-to-end latency; ``--no-stream`` sends plain JSON
requests instead (latency and throughput only: TTFT is then the whole answer's time).
``--engine-core thread|process`` is passed to the server it starts. It runs two phases and prints
one table: sequential single requests (latency p50/p95) and ``--concurrency`` clients in
parallel (throughput). Answers are checked against the scene, so a fast wrong server fails.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from fovea.demo import scenes
from fovea.progress import progress

QUESTIONS = {"caption": "Describe the image.", "count": "How many shapes are there?"}


@dataclass
class Sample:
    ttft_s: float
    total_s: float
    tokens: int
    correct: bool

    @property
    def tpot_s(self) -> float | None:
        return (self.total_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else None


def scene_request(seed: int, task: str, model: str) -> tuple[dict, str]:
    scene = scenes.SceneSampler().sample(random.Random(90_000 + seed))
    buffer = io.BytesIO()
    scenes.render(scene).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    expected = scenes.describe_answer(scene) if task == "caption" else scenes.count(scene).answer
    body = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
        "max_tokens": 48,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": QUESTIONS[task]},
        ]}],
    }
    return body, expected


async def one_request(client: httpx.AsyncClient, url: str, body: dict, expected: str, headers: dict) -> Sample:
    if not body["stream"]:
        return await one_plain_request(client, url, body, expected, headers)
    started = time.perf_counter()
    first: float | None = None
    text, tokens = "", 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                delta = choice["delta"].get("content")
                if delta:
                    first = first or time.perf_counter()
                    text += delta
    total = time.perf_counter() - started
    return Sample((first or time.perf_counter()) - started, total, tokens, text == expected)


async def one_plain_request(client: httpx.AsyncClient, url: str, body: dict, expected: str, headers: dict) -> Sample:
    started = time.perf_counter()
    response = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
    total = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    answer = response.json()
    text = answer["choices"][0]["message"]["content"] or ""
    return Sample(total, total, answer["usage"]["completion_tokens"], text == expected)


async def run_phase(url: str, model: str, concurrency: int, n: int, mix: list[str], seed0: int,
                    headers: dict, stream: bool = True) -> tuple[list[Sample], float]:
    prepared = [scene_request(seed0 + i, mix[i % len(mix)], model) for i in range(n)]
    if not stream:
        for body, _ in prepared:
            body["stream"] = False
            del body["stream_options"]
    queue: asyncio.Queue = asyncio.Queue()
    for item in prepared:
        queue.put_nowait(item)
    samples: list[Sample] = []

    async with httpx.AsyncClient(timeout=300) as client:
        started = time.perf_counter()
        with progress(total=n, desc=f"concurrency {concurrency}", unit="req") as bar:
            async def counted() -> None:
                while not queue.empty():
                    body, expected = queue.get_nowait()
                    samples.append(await one_request(client, url, body, expected, headers))
                    bar.update()

            await asyncio.gather(*(counted() for _ in range(concurrency)))
        return samples, time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))] if values else float("nan")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "fovea.cli", "--log-level", "warning", "serve", "--port", str(port),
           "--device", args.device, "--dtype", args.dtype, "--max-batch-size", str(args.max_batch_size),
           "--no-canary", "--engine-core", args.engine_core]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("fovea serve exited during start-up")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("fovea serve did not become healthy within 120 s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="server to load (default: start `fovea serve` here)")
    parser.add_argument("--model", default=None, help="model dir for the started server / model id to send")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="for the started server")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--single", type=int, default=30, help="sequential requests for latency")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64, help="requests in the concurrent phase")
    parser.add_argument("--mix", default="caption", help="comma list of tasks: caption,count")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--api-key", default=os.environ.get("FOVEA_API_KEY"))
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--no-stream", action="store_true", help="plain JSON answers instead of SSE")
    parser.add_argument("--engine-core", choices=["thread", "process"], default="process",
                        help="for the started server")
    args = parser.parse_args()

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        mix = args.mix.split(",")
        stream = not args.no_stream
        asyncio.run(run_phase(url, model, 1, args.warmup, mix, 0, headers, stream))
        single, _ = asyncio.run(run_phase(url, model, 1, args.single, mix, 1_000, headers, stream))
        loaded, wall = asyncio.run(run_phase(url, model, args.concurrency, args.requests, mix, 2_000, headers, stream))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)

    def row(name: str, samples: list[Sample], wall_s: float | None) -> dict:
        tpots = [s.tpot_s for s in samples if s.tpot_s is not None]
        return {
            "phase": name,
            "requests": len(samples),
            "correct": sum(s.correct for s in samples),
            "latency_p50_ms": 1000 * pct([s.total_s for s in samples], 0.5),
            "latency_p95_ms": 1000 * pct([s.total_s for s in samples], 0.95),
            "ttft_p50_ms": 1000 * pct([s.ttft_s for s in samples], 0.5),
            "ttft_p95_ms": 1000 * pct([s.ttft_s for s in samples], 0.95),
            "tpot_p50_ms": 1000 * statistics.median(tpots) if tpots else float("nan"),
            "req_per_s": len(samples) / wall_s if wall_s else 1 / statistics.median([s.total_s for s in samples]),
            "tok_per_s": sum(s.tokens for s in samples) / wall_s if wall_s else float("nan"),
        }

    rows = [row(name, samples, wall_s) for name, samples, wall_s in
            (("single", single, None), (f"concurrent x{args.concurrency}", loaded, wall)) if samples]
    keys = list(rows[0])
    print(" | ".join(f"{k:>15}" for k in keys))
    for r in rows:
        print(" | ".join(f"{v:>15.1f}" if isinstance(v, float) else f"{v!s:>15}" for v in r.values()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if all(r["correct"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
