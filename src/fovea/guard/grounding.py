"""Per-request grounding score: how much the answer's first tokens depend on the image.

The answer is scored twice, teacher-forced: once with the request's images and once with
every image replaced by a blank canvas of the same size. The KL divergence between the two
next-token distributions at each of the first answer tokens says how much the image moved
the answer; ``image_dependent`` compares the largest of them with the canary's calibrated
threshold. (The first token alone is not enough: a description that always starts with
"a" depends on the image only from its second word on.)

Both scorings are requests to the engine like any other: the prompt with the answer's first
tokens appended (``with_text_tokens``) asks for the whole log-probability rows of the
positions that predict those tokens (``PromptScoring.full_rows``), read from its own prefill,
and samples one token that nobody reads. The scheduler batches them with the rest of the
work; no second forward (and no memory set aside for one) exists for grounding.
"""

from __future__ import annotations

import asyncio

import torch

from fovea.engine.core.request import ErrorEvent, FinishEvent, PromptScoring
from fovea.engine.sampling.params import SamplingParams
from fovea.guard.canary import kl_divergence
from fovea.loading.loader import LoadedModel
from fovea.models.base import EncodedPrompt, with_text_tokens

SCORED_TOKENS = 8
_ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def answer_ids(loaded: LoadedModel, answer_text: str, room: int, scored_tokens: int = SCORED_TOKENS) -> list[int]:
    """The answer's first tokens to score, at most ``room`` of them (at least one): an empty
    answer scores its end-of-sequence decision."""
    ids = loaded.tokenizer(answer_text, add_special_tokens=False)["input_ids"][:min(scored_tokens, room)]
    return ids or [min(t for t in loaded.eos_token_ids if isinstance(t, int) and t >= 0)]


async def answer_logprobs(engine, prompt: EncodedPrompt, ids: list[int], request_id: str | None = None
                          ) -> torch.Tensor:
    """[len(ids), vocab] float32 log-probabilities of each answer position, teacher-forced by the
    engine (``engine``: a ``PagedEngine``)."""
    scoring = PromptScoring(full_rows=len(ids))
    async for event in engine.generate(with_text_tokens(prompt, ids), _ONE_TOKEN, request_id, scoring=scoring):
        if isinstance(event, ErrorEvent):
            raise event.error
        if isinstance(event, FinishEvent):
            assert event.prompt_rows is not None
            return event.prompt_rows
    raise RuntimeError("the engine ended a grounding score without finishing it")


async def answer_dependence(engine, loaded: LoadedModel, prompt: EncodedPrompt, blank_twin: EncodedPrompt,
                            answer_text: str, threshold: float, scored_tokens: int = SCORED_TOKENS,
                            request_id: str | None = None) -> dict:
    # Each scoring is its prompt, the answer's tokens and the one token it samples: within the
    # per-sequence limit (re-tokenised text may count more tokens than the answer had).
    room = engine.max_context - len(prompt.input_ids) - 1
    ids = answer_ids(loaded, answer_text, room, scored_tokens)
    rid = request_id or "grounding"
    real, blank = await asyncio.gather(answer_logprobs(engine, prompt, ids, f"{rid}-image"),
                                       answer_logprobs(engine, blank_twin, ids, f"{rid}-blank"))
    kls = [kl_divergence(real[i], blank[i]) for i in range(len(ids))]
    return {
        "scored_tokens": len(ids),
        "kl_per_token": [round(k, 6) for k in kls],
        "mean_kl": round(sum(kls) / len(kls), 6),
        "max_kl": round(max(kls), 6),
        "threshold": round(threshold, 6),
        "image_dependent": max(kls) > threshold,
    }
