"""End-to-end check of the paged engine on a device, against transformers' generate.

    python3 bench/paged_selfcheck.py --device cuda [--dtype float32|bfloat16] [--chunk 24]

Loads the shipped demo model, serves a batch of fresh scenes through PagedEngine (with
the Triton decode and CUDA graphs when on CUDA) and compares each greedy answer with
transformers' generate on the same device. Exits 1 if any answer differs. (A diagnostic on
the demo model, so it lives with the benchmarks: the serving package does not depend on
``fovea.demo``.)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fovea.demo import scenes
from fovea.engine.config import PagedEngineConfig
from fovea.engine.core.request import ErrorEvent, FinishEvent, TokenEvent
from fovea.engine.engine import PagedEngine
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.loader import load_model
from fovea.loading.prompt import encode_prompt, render_chat


async def _collect(engine: PagedEngine, prompt, params) -> list[int]:
    tokens = []
    async for event in engine.generate(prompt, params):
        if isinstance(event, TokenEvent) and event.token_id >= 0:
            tokens.append(event.token_id)
        elif isinstance(event, ErrorEvent):
            raise event.error
        elif isinstance(event, FinishEvent):
            break
    return tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="paged engine vs transformers generate")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--chunk", type=int, default=None, help="max_num_batched_tokens (e.g. 24)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    loaded = load_model(None, device=args.device, dtype=args.dtype)
    rng = random.Random(4242)
    prompts = []
    for _ in range(args.requests):
        image = scenes.render(scenes.SceneSampler().sample(rng))
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
        prompts.append(encode_prompt(loaded, render_chat(loaded, messages), [image]))
    # The step overlap and the fused vision stage are forced on: the demo model is below the
    # size where they are on by default, and this check must cover what LLaVA-7B runs.
    engine = PagedEngine(loaded, PagedEngineConfig(max_num_batched_tokens=args.chunk, overlap_steps=True,
                                                   fused_vision=True))
    params = SamplingParams(max_tokens=40, temperature=0.0)

    async def serve():
        engine.start()
        try:
            return await asyncio.gather(*(_collect(engine, p, params) for p in prompts))
        finally:
            engine.stop()

    started = time.perf_counter()
    ours = asyncio.run(serve())
    seconds = time.perf_counter() - started
    same = 0
    for prompt, tokens in zip(prompts, ours):
        ids = torch.tensor([prompt.input_ids], device=loaded.device)
        with torch.no_grad():
            ref = loaded.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                        pixel_values=prompt.pixel_values.to(loaded.device), max_new_tokens=40, do_sample=False)
        ref_tokens = ref[0, ids.shape[1]:].tolist()
        if ref_tokens and ref_tokens[-1] in loaded.eos_token_ids:
            ref_tokens = ref_tokens[:-1]
        same += tokens == ref_tokens
    runner = engine.runner
    graphs = runner.graphs
    print(f"device={loaded.device} dtype={args.dtype} attention={runner.attention.name} "
          f"graph_sizes={graphs.sizes if graphs else None} graph_replays={graphs.replayed if graphs else 0} "
          f"steps={engine.steps} queued_ahead={engine.steps_queued_ahead} kv_blocks={runner.kv_plan.num_blocks} ({runner.kv_plan.source})")
    print(f"{same}/{len(prompts)} answers token-identical to transformers generate; "
          f"{len(prompts)} requests in {seconds:.2f} s")
    # Every answer must match, in every dtype: the demo model's logits are far from ties, and
    # fovea's kernels round where transformers' eager ops round.
    ok = same == len(prompts)
    print("PASS" if ok else f"FAIL: {len(prompts) - same} answer(s) differ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
