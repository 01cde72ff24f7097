"""Probe: what the paged engine's step overlap and fused vision stage do to the demo model, whose
steps are so short that host work sets the pace (the opposite of the 7B benchmark).

    python3 bench/demo_paged_probe.py [--device cuda] [--requests 32]

For each combination of ``overlap_steps`` and ``fused_vision``: sequential single requests
(latency p50, time per output token) and 16 closed-loop clients (requests/s), prompts
preprocessed beforehand, so only the engine is timed. Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.core.request import FinishEvent, TokenEvent
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.loader import load_model
from fovea.loading.prompt import encode_prompt, render_chat

QUESTION = [{"type": "image"}, {"type": "text", "text": "Describe the image."}]
GREEDY = SamplingParams(max_tokens=48, temperature=0)


async def one(engine, prompt) -> tuple[float, float, int]:
    started, first, tokens = time.perf_counter(), None, 0
    async for event in engine.generate(prompt, GREEDY):
        if isinstance(event, TokenEvent) and first is None:
            first = time.perf_counter()
        if isinstance(event, FinishEvent):
            tokens = event.completion_tokens
    total = time.perf_counter() - started
    return total, (total - (first - started)) / max(1, tokens - 1), tokens


async def closed_loop(engine, prompts, clients: int) -> float:
    queue = list(prompts)

    async def worker():
        while queue:
            await one(engine, queue.pop())

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return len(prompts) / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    loaded = load_model(None, args.device, args.dtype)
    text = render_chat(loaded, [{"role": "user", "content": QUESTION}])
    images = [scenes.render(scenes.SceneSampler().sample(random.Random(70_000 + i))) for i in range(3 * args.requests)]
    prompts = [encode_prompt(loaded, text, [image]) for image in images]
    print(f"{'overlap':>8}{'fused vision':>14}{'single p50 ms':>15}{'ms/token':>10}{'16 clients req/s':>18}")
    for overlap in (True, False):
        for fused_vision in (True, False):
            engine = PagedEngine(loaded, PagedEngineConfig(max_num_seqs=16, overlap_steps=overlap,
                                                           fused_vision=fused_vision))
            engine.start()
            try:
                asyncio.run(closed_loop(engine, prompts[:8], 4))  # warm-up
                singles = [asyncio.run(one(engine, p)) for p in prompts[:args.requests]]
                rate = asyncio.run(closed_loop(engine, prompts[args.requests:], 16))
            finally:
                engine.stop()
            print(f"{overlap!s:>8}{fused_vision!s:>14}{1e3 * statistics.median(s[0] for s in singles):15.1f}"
                  f"{1e3 * statistics.median(s[1] for s in singles):10.2f}{rate:18.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
