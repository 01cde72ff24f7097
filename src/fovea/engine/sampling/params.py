"""Sampling parameters and next-token selection (greedy, temperature, top-k, top-p, min-p, seeded).

Penalties, logit bias and stop-token masks are applied to a step's rows together before this
(``engine/sampling/logits_processors.py``); log-probabilities are taken from the raw logits
(``engine/sampling/logprobs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

GREEDY_BELOW = 1e-4
MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # vLLM's extensions: with ignore_eos an end-of-sequence token does not end the answer (it
    # is generated and the answer goes on); before min_tokens tokens exist no end-of-sequence
    # token can be sampled and no stop string ends the answer.
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int = 0  # vLLM: keep the k most likely tokens; 0 or -1: off
    min_p: float = 0.0  # vLLM: drop tokens less likely than min_p times the most likely one
    # OpenAI's penalties on the tokens generated so far (-2..2), and vLLM's repetition penalty
    # (> 0; 1 is off) on the prompt's and the generated tokens, as transformers applies it.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (-100..100)
    # vLLM: generating one of these ends the answer (finish_reason "stop"); the token counts as
    # generated but is not in the text, and it cannot be sampled before min_tokens.
    stop_token_ids: list[int] = field(default_factory=list)
    # None: no log-probabilities; k >= 0: the sampled token's and the k most likely (k <= 20).
    logprobs: int | None = None
    n: int = 1  # choices generated from the one prompt (see ``choice``)
    # Structured outputs: the compiled grammar (engine/structured's Grammar) the answer must match
    # (None: free text).
    grammar: Any = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be between 0 and 2")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1, 0 (off) or positive")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be between 0 and 1")
        if not (-2.0 <= self.presence_penalty <= 2.0 and -2.0 <= self.frequency_penalty <= 2.0):
            raise ValueError("presence_penalty and frequency_penalty must be between -2 and 2")
        if not self.repetition_penalty > 0.0:
            raise ValueError("repetition_penalty must be positive")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be between -100 and 100")
        if self.n < 1:
            raise ValueError("n must be at least 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        # Below this temperature softmax(logits / T) overflows; its limit is the arg-max anyway.
        return self.temperature < GREEDY_BELOW

    def choice(self, index: int) -> SamplingParams:
        """The parameters of choice ``index`` of ``n``: one answer, seeded ``seed + index`` (as
        vLLM seeds its child requests), so choice 0 is the answer n=1 gives with that seed and
        each choice is reproducible on its own. Without a seed every choice draws its own."""
        seed = None if self.seed is None else (self.seed + index) % 2**64  # torch.Generator's range
        return replace(self, n=1, seed=seed)

    @property
    def penalised(self) -> bool:
        """Does the sampler keep per-sequence token counts on the device for this request?"""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processed(self) -> bool:
        """Do this request's logits go through ``logits_processors`` before sampling?"""
        return self.penalised or bool(self.logit_bias) or bool(self.stop_token_ids)

    @property
    def truncates(self) -> bool:
        """Top-k or min-p cut the distribution (top-p has its own branch)."""
        return self.top_k > 0 or self.min_p > 0.0

    def eos_blocked(self, produced: int) -> bool:
        """With ``produced`` tokens already generated, may the next one not be end-of-sequence?"""
        return produced < self.min_tokens

    def ends_on_eos(self, produced: int) -> bool:
        """Does an end-of-sequence token that is the ``produced``-th token end the answer?"""
        return not self.ignore_eos and produced >= self.min_tokens

    def stops_checked(self, produced: int) -> bool:
        """Are stop strings checked once ``produced`` tokens exist (vLLM: not before min_tokens)?"""
        return produced >= self.min_tokens


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits ([vocab])."""
    return int(sample_next_on_device(logits, params, generator).item())


def sample_next_on_device(logits: torch.Tensor, params: SamplingParams,
                          generator: torch.Generator | None) -> torch.Tensor:
    """``sample_next`` without reading the result back: a 0-d int64 tensor on the logits'
    device, so the engine can queue the next step before the token reaches the host."""
    if params.greedy:
        return torch.argmax(logits)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.truncates:
        probs = truncate(probs, params.top_k, params.min_p)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        keep = cumulative - sorted_probs < params.top_p
        keep[0] = True  # the most likely token always stays, however small top_p is
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return order[choice][0]
    return torch.multinomial(probs, 1, generator=generator)[0]


def truncate(probs: torch.Tensor, top_k: int, min_p: float) -> torch.Tensor:
    """``probs`` ([vocab]) with the tokens outside the top ``top_k`` and those below ``min_p``
    times the largest probability set to 0 (both keep a most-likely prefix, so their order does
    not matter; the most likely token always stays), renormalised: top-p then reads the truncated
    distribution, as in vLLM, which applies min-p before top-k and top-p."""
    if 0 < top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if min_p > 0.0:
        probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()
