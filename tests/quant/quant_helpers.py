"""What the quantized-checkpoint tests share: a prompt with an image, and the engine's greedy answers."""

from __future__ import annotations

from engine_runs import tokens_of
from PIL import Image

from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.prompt import encode_prompt, render_chat

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def chat(loaded, seed: int, text: str = "What is in the image?"):
    image = Image.effect_noise((96, 80), 30 + seed).convert("RGB")
    content = [{"type": "image"}, {"type": "text", "text": text}]
    return encode_prompt(loaded, render_chat(loaded, [{"role": "user", "content": content}]), [image])


def engine_greedy(loaded, prompts) -> list[list[int]]:
    return tokens_of(PagedEngine(loaded, PagedEngineConfig(num_blocks=128, max_num_batched_tokens=64)), prompts, GREEDY)
