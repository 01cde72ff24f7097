"""Greedy answers of the tiny Qwen2.5-VL and Qwen3-VL checkpoints with the fused vision stage
(``engine.vision.qwen_vision_fused``, its torch ops on this CPU) equal transformers' ``generate``:
several images of different sizes and aspect ratios per prompt, encoded in one packed call."""

from __future__ import annotations

import random

import pytest
from engine_runs import tokens_of
from PIL import Image

from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.reference import reference_generate
from fovea.engine.sampling.params import SamplingParams
from fovea.engine.vision.qwen_vision_fused import QwenFusedVision
from fovea.loading.loader import load_model
from fovea.loading.prompt import encode_prompt, render_chat
from fovea.testing import random_qwen2_5_vl, random_qwen3_vl

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SIZES = [(300, 200), (64, 90), (5, 300), (900, 700)]


def noise(width: int, height: int, seed: int) -> Image.Image:
    rng = random.Random(seed)
    image = Image.effect_noise((width, height), 40 + seed % 30).convert("RGB")
    shifts = [rng.randrange(60) for _ in range(3)]
    return Image.merge("RGB", [band.point(lambda v, s=shift: (v + s) % 256) for band, shift in zip(image.split(), shifts)])


def chat(model, images, text):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    return encode_prompt(model, render_chat(model, [{"role": "user", "content": content}]), images)


def generate(engine: PagedEngine, prompts) -> list[list[int]]:
    return tokens_of(engine, prompts, GREEDY)


@pytest.mark.parametrize("writer", [random_qwen2_5_vl.write_model_dir, random_qwen3_vl.write_model_dir],
                         ids=["qwen2_5_vl", "qwen3_vl"])
def test_greedy_tokens_with_the_fused_stage_equal_transformers_generate(tmp_path, writer):
    loaded = load_model(writer(tmp_path / "model", arch="tiny", seed=3), "cpu", "float32")
    prompts = [chat(loaded, [noise(w, h, 10 + i), noise(h, w, 20 + i)], text)
               for i, ((w, h), text) in enumerate(zip(SIZES, ["you", "a helpful", "are you", "assistant"]))]
    engine = PagedEngine(loaded, PagedEngineConfig(num_blocks=256, max_num_batched_tokens=64))
    fused = QwenFusedVision(loaded)
    calls = []

    def encode(images):
        calls.append(len(images))
        return fused(images)

    engine.runner.embedder.images.encode = encode  # what the runner chooses on a GPU
    results = generate(engine, prompts)
    assert calls and sum(calls) == 2 * len(prompts) and max(calls) > 1  # images of several sizes per call
    for prompt, tokens in zip(prompts, results):
        ref = reference_generate(loaded, prompt, 10)  # stops at EOS; the engine ignores it
        assert ref and tokens[:len(ref)] == ref
