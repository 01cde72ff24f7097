"""What the quantized-checkpoint tests share: a prompt with an image, and the engine's greedy answers."""

from __future__ import annotations

import asyncio

from PIL import Image

from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.core.request import ErrorEvent, FinishEvent, TokenEvent
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.prompt import encode_prompt, render_chat

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def chat(loaded, seed: int, text: str = "What is in the image?"):
    image = Image.effect_noise((96, 80), 30 + seed).convert("RGB")
    content = [{"type": "image"}, {"type": "text", "text": text}]
    return encode_prompt(loaded, render_chat(loaded, [{"role": "user", "content": content}]), [image])


def engine_greedy(loaded, prompts) -> list[list[int]]:
    engine = PagedEngine(loaded, PagedEngineConfig(num_blocks=128, max_num_batched_tokens=64))

    async def one(prompt):
        tokens = []
        async for event in engine.generate(prompt, GREEDY):
            if isinstance(event, TokenEvent) and event.token_id >= 0:
                tokens.append(event.token_id)
            elif isinstance(event, ErrorEvent):
                raise event.error
            elif isinstance(event, FinishEvent):
                return tokens
        raise AssertionError("no finish event")

    async def main():
        engine.start()
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            engine.stop()

    return asyncio.run(main())
