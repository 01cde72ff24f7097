"""Structured requests mixed with plain ones under concurrency: how many fail (issue 23, item 10).

    python bench/structured_mixed_load.py                   # starts `fovea serve` on the demo model itself
    python bench/structured_mixed_load.py --url http://127.0.0.1:8000 --requests 100 --concurrency 8

Every ``--every``-th request carries one of the structured formats the issue found failing on
the demo at temperature 0 (a choice or regex over words "Describe the image." makes unlikely);
the others are plain captions and counts. Half of each kind stream. A request fails when it is
not a 200, a stream does not end with ``[DONE]`` after a finish reason, an error event arrives,
or a structured answer does not match its format. Prints the counts; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections import Counter

import httpx
from http_load import scene_request, start_server

FORMATS = [  # (structured_outputs, what the answer must match)
    ({"choice": ["one", "two", "three"]}, "one|two|three"),
    ({"regex": "(one|two|three)"}, "one|two|three"),
    ({"choice": ["a red circle", "one"]}, "a red circle|one"),
]


def request(i: int, model: str, every: int) -> tuple[dict, str | None]:
    """The i-th request's body and, for a structured one, the regex its answer must match."""
    structured = i % every == 0
    body, _ = scene_request(i, "caption" if structured or (i // every) % 2 else "count", model)
    body.update(stream=i % 4 < 2, temperature=0)
    if not body["stream"]:
        body.pop("stream_options")
    if not structured:
        return body, None
    fmt, allowed = FORMATS[(i // every) % len(FORMATS)]
    body.update(structured_outputs=fmt, max_tokens=8)
    return body, allowed


async def one(client: httpx.AsyncClient, url: str, body: dict, allowed: str | None) -> str:
    """'ok', or why this request failed."""
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        raw = (await response.aread()).decode()
    if response.status_code != 200:
        return f"HTTP {response.status_code}"
    if body["stream"]:
        lines = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        if not lines or lines[-1] != "[DONE]":
            return "stream without [DONE]"
        text, finish = "", None
        for line in lines[:-1]:
            chunk = json.loads(line)
            if "error" in chunk:
                return f"error event {chunk['error'].get('code')}"
            for choice in chunk.get("choices", []):
                text += choice["delta"].get("content") or ""
                finish = choice.get("finish_reason") or finish
        if finish is None:
            return "stream without a finish reason"
    else:
        text = json.loads(raw)["choices"][0]["message"]["content"]
    if allowed is not None and not re.fullmatch(allowed, text):
        return f"answer {text!r} does not match"
    return "ok"


async def run(url: str, model: str, n: int, concurrency: int, every: int) -> Counter:
    jobs = [request(i, model, every) for i in range(n)]
    outcomes: Counter = Counter()
    limit = asyncio.Semaphore(concurrency)

    async def limited(client: httpx.AsyncClient, body: dict, allowed: str | None) -> None:
        async with limit:
            kind = "structured" if allowed else "plain"
            outcomes[(kind, await one(client, url, body, allowed))] += 1

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(limited(client, body, allowed) for body, allowed in jobs))
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="server to load (default: start `fovea serve` here)")
    parser.add_argument("--model", default=None, help="model dir for the started server")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--every", type=int, default=2, help="one request in this many is structured")
    args = parser.parse_args()
    proc, url = (None, args.url) if args.url else start_server(args)
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        started = time.perf_counter()
        outcomes = asyncio.run(run(url, model, args.requests, args.concurrency, args.every))
        wall = time.perf_counter() - started
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    for (kind, outcome), count in sorted(outcomes.items()):
        print(f"{kind:>10}  {outcome:<40} {count}")
    failed = sum(count for (_, outcome), count in outcomes.items() if outcome != "ok")
    print(f"{args.requests} requests at concurrency {args.concurrency} in {wall:.1f} s: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
