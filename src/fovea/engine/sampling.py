"""Sampling parameters and next-token selection (greedy, temperature, top-p, seeded)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

GREEDY_BELOW = 1e-4


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
    # Structured outputs: a compiled xgrammar grammar the answer must match (None: free text).
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

    @property
    def greedy(self) -> bool:
        # Below this temperature softmax(logits / T) overflows; its limit is the arg-max anyway.
        return self.temperature < GREEDY_BELOW


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
