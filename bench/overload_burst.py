"""Overload through HTTP: bursts of concurrent streamed requests, every answer classified.

    python3 bench/overload_burst.py --out $OUT [--arch llava-1.5-7b] [--burst 512] [--max-tokens 512]
        [--bursts 2] [--configs "default;--max-queue 64"]

For each server configuration (a `fovea serve` process on a random-weight directory from
fovea.testing.random_llava; `tiny` runs on a CPU), it sends ``--bursts`` bursts of ``--burst``
concurrent streamed chat requests (a distinct photo-like JPEG each, ``ignore_eos``) and sorts every
answer into one of:

- ``done``: HTTP 200, a finish_reason, usage, and ``[DONE]``;
- ``refused``: a 429/503 with ``Retry-After`` before any byte of a stream (the server would not
  queue it);
- ``error_event``: a stream that began and ended with an error event and ``[DONE]``;
- ``dead``: anything else (a 200 that stops with no ``[DONE]``, a dropped connection, another
  status). This is the defect issue 23 item 8 is about; the exit status is 1 when any occurs.

The last lines are a table; everything is also in $OUT/overload_burst.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import serve_load as load  # noqa: E402
from gpu_serve import Server  # noqa: E402

from fovea.testing.random_llava import prompt_words, write_model_dir  # noqa: E402


async def classify(client: httpx.AsyncClient, url: str, body: dict) -> str:
    """One request's outcome: done, refused, error_event or dead (see the module's docstring)."""
    finish = usage = None
    done = errored = False
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code in (429, 503):
                await response.aread()
                return "refused" if response.headers.get("retry-after") else "dead"
            if response.status_code != 200:
                return "dead"
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                errored = errored or "error" in chunk
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", ()):
                    finish = choice.get("finish_reason") or finish
    except (httpx.HTTPError, OSError):
        return "dead"
    if done and errored:
        return "error_event"
    return "done" if done and finish and usage else "dead"


async def one_burst(url: str, bodies: list[dict]) -> tuple[Counter, float]:
    async with load.client(len(bodies)) as client:
        started = time.perf_counter()
        outcomes = await asyncio.gather(*(classify(client, url, b) for b in bodies))
        return Counter(outcomes), time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/fovea-overload"))
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/fovea-llava-1.5-7b"))
    parser.add_argument("--arch", default="llava-1.5-7b", help="fovea.testing.random_llava architecture (tiny: CPU)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--burst", type=int, default=512)
    parser.add_argument("--bursts", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--text-tokens", type=int, default=64)
    parser.add_argument("--configs", default="default;--max-queue 64",
                        help="';'-separated `fovea serve` flag sets ('default' for none)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.model_dir / "config.json").exists():
        write_model_dir(args.model_dir, args.arch)
    name = args.model_dir.name
    report = []
    for n_config, config in enumerate(c.strip() for c in args.configs.split(";")):
        flags = [] if config == "default" else shlex.split(config)
        server = Server(args.model_dir, args.out, f"overload-{n_config}", *flags, "--served-model-name", name,
                        device=args.device)
        try:
            ready_s = server.wait_ready()
            for n_burst in range(args.bursts):
                first = 100_000 * (n_config + 1) + 1000 * n_burst
                bodies = [load.chat_body(name, seed, prompt_words(args.text_tokens, seed), args.max_tokens)
                          for seed in range(first, first + args.burst)]
                counts, wall = asyncio.run(one_burst(server.url, bodies))
                entry = {"config": config, "burst": n_burst + 1, "requests": args.burst, "wall_s": round(wall, 1),
                         "ready_s": round(ready_s, 1), **{k: counts.get(k, 0) for k in
                                                          ("done", "refused", "error_event", "dead")}}
                report.append(entry)
                print(json.dumps(entry), flush=True)
        finally:
            server.stop()
    (args.out / "overload_burst.json").write_text(json.dumps(report, indent=2))
    print(f"\n{'config':<34} {'burst':>5} {'reqs':>5} {'done':>5} {'refused':>7} {'err_evt':>7} {'dead':>5} {'wall s':>7}")
    for e in report:
        print(f"{e['config']:<34} {e['burst']:>5} {e['requests']:>5} {e['done']:>5} {e['refused']:>7} "
              f"{e['error_event']:>7} {e['dead']:>5} {e['wall_s']:>7}")
    return 1 if any(e["dead"] for e in report) else 0


if __name__ == "__main__":
    sys.exit(main())
