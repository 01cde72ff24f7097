"""An image the encode workers cannot deliver fails its own request only, never the step's others."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from scene_helpers import fresh_scene

from fovea.demo import scenes
from fovea.disagg.handoff import HandoffMismatch
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.core.request import ErrorEvent, FinishEvent
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.prompt import encode_prompt, render_chat


class FlakyEncoders:
    """Stands in for an encoder pool: the local vision stage, except for one refused image."""

    def __init__(self, model, refuse: str) -> None:
        self.forward = model.adapter.vision_forward(model)
        self.refuse = refuse
        self.executor = ThreadPoolExecutor(2)

    def encode(self, images):
        if any(image.hash == self.refuse for image in images):
            raise HandoffMismatch("image", "the encoder sent another image's rows")
        return self.forward(images)

    def submit(self, images):
        return self.executor.submit(self.encode, images)


def prompt(model, seed):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    return encode_prompt(model, render_chat(model, messages), [scenes.render(fresh_scene(seed))])


def test_only_the_request_whose_image_was_refused_fails(demo_model):
    good, bad, other = (prompt(demo_model, s) for s in (60_000, 60_001, 60_002))
    engine = PagedEngine(demo_model, PagedEngineConfig(num_blocks=256),
                         remote_encoder=FlakyEncoders(demo_model, bad.image_hashes[0]))
    params = SamplingParams(max_tokens=40, temperature=0)

    async def events(p):
        return [event async for event in engine.generate(p, params)]

    async def main():
        engine.start()
        try:
            return await asyncio.gather(*(events(p) for p in (good, bad, other)))
        finally:
            engine.stop()

    first, refused, third = asyncio.run(main())
    assert len(refused) == 1 and isinstance(refused[0], ErrorEvent)
    assert isinstance(refused[0].error, HandoffMismatch) and refused[0].error.reason == "image"
    for answer, seed in ((first, 60_000), (third, 60_002)):
        assert isinstance(answer[-1], FinishEvent) and answer[-1].text == scenes.describe_answer(fresh_scene(seed))
    assert engine.runner.embedder.images.prefetch_hits >= 2
