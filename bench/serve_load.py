"""HTTP load for an OpenAI-compatible VLM server: photo-like images, fixed output lengths, and
every request checked, so a failed or truncated answer is counted, never averaged in.

Used by bench/gpu_serve.py. Each request streams (SSE) one distinct 336 px JPEG and a text of
a known token count, asks for ``max_tokens`` with ``ignore_eos`` and counts as failed unless it
ends with finish_reason "length", usage.completion_tokens == max_tokens and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from PIL import Image


def photo_jpeg(seed: int, size: int | tuple[int, int] = 336, quality: int = 90) -> bytes:
    """A distinct photo-like JPEG of ``size`` px square or (width, height): smooth colour fields,
    a few soft blobs and sensor noise."""
    rng = np.random.default_rng(seed)
    width, height = (size, size) if isinstance(size, int) else size
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    y, x = y / height, x / width
    img = np.empty((height, width, 3), np.float32)
    for c in range(3):
        fx, fy, phase = rng.uniform(0.3, 3, 2).tolist() + [rng.uniform(0, 6.28)]
        img[..., c] = 110 + 70 * np.sin(6.28 * (fx * x + phase)) * np.cos(6.28 * fy * y)
    for _ in range(4):
        cx, cy, r = rng.uniform(0, 1, 2).tolist() + [rng.uniform(0.05, 0.25)]
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))
        img += blob[..., None] * rng.uniform(-80, 80, 3)
    img += rng.normal(0, 6, img.shape)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def chat_body(model: str, seed: int, text: str, max_tokens: int, images: int = 1,
              size: int | tuple[int, int] = 336) -> dict:
    """A streamed chat request: ``images`` distinct photo-like JPEGs of ``size``, then the text."""
    parts = [{"type": "image_url", "image_url": {
        "url": "data:image/jpeg;base64," + base64.b64encode(photo_jpeg(seed * 16 + k if images > 1 else seed,
                                                                       size)).decode()}}
        for k in range(images)]
    return {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


@dataclass
class Result:
    ok: bool
    ttft_s: float = math.nan
    total_s: float = math.nan
    tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float:
        return (self.total_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else math.nan


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    started = time.perf_counter()
    first = None
    finish, usage, done, error = None, None, False, ""
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return Result(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    error = f"error event: {chunk['error'].get('code')}: {chunk['error'].get('message', '')[:120]}"
                    continue
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", ()):
                    if choice.get("delta", {}).get("content") and first is None:
                        first = time.perf_counter()
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
    except (httpx.HTTPError, OSError) as exc:
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    total = time.perf_counter() - started
    tokens = (usage or {}).get("completion_tokens", 0)
    want = body["max_tokens"]
    if error or not done or finish != "length" or tokens != want:
        return Result(False, error=error or f"truncated: finish={finish} tokens={tokens}/{want} done={done}")
    return Result(True, (first or time.perf_counter()) - started, total, tokens)


def client(concurrency: int) -> httpx.AsyncClient:
    # httpx allows 100 connections by default: a 256-request burst would queue in the client.
    limits = httpx.Limits(max_connections=concurrency + 16, max_keepalive_connections=concurrency + 16)
    return httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits)


async def burst(url: str, bodies: list[dict]) -> tuple[list[Result], float]:
    async with client(len(bodies)) as c:
        started = time.perf_counter()
        results = await asyncio.gather(*(stream_one(c, url, b) for b in bodies))
        return list(results), time.perf_counter() - started


async def sequential(url: str, bodies: list[dict]) -> list[Result]:
    async with client(1) as c:
        return [await stream_one(c, url, b) for b in bodies]


async def poisson(url: str, bodies: list[dict], rate: float, seconds: float, seed: int = 0) -> tuple[list[Result], float]:
    """Open-loop arrivals at ``rate`` per second for ``seconds`` (as many bodies as arrive are used);
    returns every arrival's result and the time until the last answer."""
    rng = random.Random(seed)
    arrivals, t = [], rng.expovariate(rate)
    while t < seconds and len(arrivals) < len(bodies):
        arrivals.append(t)
        t += rng.expovariate(rate)
    async with client(len(arrivals)) as c:
        started = time.perf_counter()

        async def at(delay: float, body: dict) -> Result:
            await asyncio.sleep(max(0.0, started + delay - time.perf_counter()))
            return await stream_one(c, url, body)

        results = await asyncio.gather(*(at(d, b) for d, b in zip(arrivals, bodies)))
        return list(results), time.perf_counter() - started


def pct(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


@dataclass
class Summary:
    requests: int
    failed: int
    wall_s: float
    tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    errors: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else math.nan


def summarize(results: list[Result], wall_s: float) -> Summary:
    good = [r for r in results if r.ok]
    errors = sorted({r.error for r in results if not r.ok})[:5]
    return Summary(len(results), len(results) - len(good), wall_s, sum(r.tokens for r in good),
                   1e3 * pct([r.ttft_s for r in good], 0.5), 1e3 * pct([r.ttft_s for r in good], 0.99),
                   1e3 * pct([r.tpot_s for r in good], 0.5), 1e3 * pct([r.tpot_s for r in good], 0.99), errors)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan
