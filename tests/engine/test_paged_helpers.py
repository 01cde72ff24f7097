"""Shared helpers of the paged-engine tests (no tests here): fake sequences, prompts, a collector
and memoised transformers references. Named test_paged_* only to stay inside the test set."""

from __future__ import annotations

import threading

import torch

from fovea.engine.core.request import EngineRequest
from fovea.engine.core.sequence import Sequence
from fovea.engine.reference import reference_generate
from fovea.engine.sampling.params import SamplingParams
from fovea.loading.prompt import EncodedPrompt, ImageInput, encode_prompt, render_chat

IMAGE = 4  # the demo model's image token id


def fake_seq(seq_id: int, token_ids: list[int], image_hashes: list[str] | None = None,
             tokens_per_image: int = 0, max_tokens: int = 8) -> Sequence:
    images = [ImageInput(torch.zeros(1), tokens_per_image, key) for key in image_hashes or []]
    prompt = EncodedPrompt(list(token_ids), images, "")
    request = EngineRequest(f"r{seq_id}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0),
                            emit=lambda event: None)
    return Sequence(seq_id, request, IMAGE, torch.device("cpu"), tokenizer=None)


def prompt_for(model, image, question: str = "Describe the image."):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    return encode_prompt(model, render_chat(model, messages), [image])


_reference_lock = threading.Lock()
_reference: dict[tuple, list[int]] = {}


def reference_tokens(model, prompt, max_tokens: int = 40) -> list[int]:
    """Greedy tokens of transformers' own generate (EOS dropped), memoised per prompt."""
    key = (tuple(prompt.input_ids), tuple(prompt.image_hashes), max_tokens)
    with _reference_lock:
        if key not in _reference:
            _reference[key] = reference_generate(model, prompt, max_tokens)
        return _reference[key]
