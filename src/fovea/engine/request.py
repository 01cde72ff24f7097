"""What the engine is asked to do, and what it reports back while doing it."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from fovea.engine.sampling import SamplingParams
from fovea.model.prompt import EncodedPrompt


@dataclass(slots=True)
class TokenEvent:
    text: str  # new final text (may be empty while a stop string is pending)
    token_id: int


@dataclass(slots=True)
class FinishEvent:
    finish_reason: str  # "stop" | "length" | "cancelled"
    text: str
    prompt_tokens: int
    completion_tokens: int
    first_token_s: float | None  # seconds from arrival to the first token
    total_s: float
    first_logprobs: torch.Tensor | None = None  # [vocab] log-probabilities of the first token, if asked


@dataclass(slots=True)
class ErrorEvent:
    error: BaseException


Event = TokenEvent | FinishEvent | ErrorEvent


@dataclass
class EngineRequest:
    request_id: str
    prompt: EncodedPrompt
    params: SamplingParams
    emit: Callable[[Event], None]  # called from the engine thread; must not block
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    want_first_logprobs: bool = False  # for grounding scores and the canary's image ablation
    first_logprobs: torch.Tensor | None = None
