"""On a real GPU: the sampling options (penalties, logit bias, stop-token ids, logprobs, n) launch
without making the host wait for the GPU, so the step stays queued one ahead, and answer as
they do without step overlap.

Skipped without CUDA (CI has none); scripts/gpu_engine_checks.sh runs these on the lent H200.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from scene_helpers import fresh_scene

from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine import engine as engine_module
from fovea.engine.core.in_flight import InFlight
from fovea.engine.core.request import FinishEvent, TokenEvent
from fovea.engine.sampling import logprobs as logprobs_module
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.loader import load_model
from fovea.loading.prompt import encode_prompt, render_chat

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

JOBS = [
    SamplingParams(max_tokens=12, temperature=0),
    SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5,
                   logprobs=5, logit_bias={12: 2.0}),
    SamplingParams(max_tokens=12, temperature=1.2, seed=4, n=3, logprobs=0, stop_token_ids=[10], top_k=5, min_p=0.05),
]


@pytest.fixture(scope="module")
def gpu_model():
    return load_model(None, "cuda", "float32")


def strict(fn):
    """``fn`` with every synchronising CUDA call an error (torch's sync debug mode)."""
    def wrapped(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return wrapped


def run(engine, prompt) -> list[dict]:
    async def one(params):
        out: dict[int, list] = {}
        async for event in engine.generate(prompt, params):
            assert isinstance(event, (TokenEvent, FinishEvent)), event
            if isinstance(event, TokenEvent):
                out.setdefault(event.index, []).append(
                    (event.token_id, None if event.logprob is None else round(event.logprob.logprob, 3)))
        return out

    async def main():
        engine.start()
        try:
            return await asyncio.gather(*(one(p) for p in JOBS))
        finally:
            engine.stop()
    return asyncio.run(main())


def test_sampling_options_never_make_the_host_wait(gpu_model, monkeypatch):
    text = render_chat(gpu_model, [{"role": "user", "content": [{"type": "image"},
                                                              {"type": "text", "text": "Describe the image."}]}])
    prompt = encode_prompt(gpu_model, text, [scenes.render(fresh_scene(91))])
    monkeypatch.setattr(engine_module, "sample_on_device", strict(engine_module.sample_on_device))
    monkeypatch.setattr(logprobs_module, "asked", strict(logprobs_module.asked))
    monkeypatch.setattr(logprobs_module.AskedLogprobs, "gather", strict(logprobs_module.AskedLogprobs.gather))
    monkeypatch.setattr(InFlight, "start", staticmethod(strict(InFlight.start)))
    overlapped = PagedEngine(gpu_model, PagedEngineConfig(num_blocks=256, overlap_steps=True))
    got = run(overlapped, prompt)
    assert overlapped.steps_queued_ahead > 0 and overlapped.token_counts.capacity > 0
    monkeypatch.undo()
    assert got == run(PagedEngine(gpu_model, PagedEngineConfig(num_blocks=256, overlap_steps=False)), prompt)
