"""What the engine is asked to do, and what it reports back while doing it."""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from fovea.engine.sampling.params import MAX_LOGPROBS, SamplingParams
from fovea.errors import InvalidRequest, Overloaded
from fovea.loading.prompt import EncodedPrompt


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely tokens at its position (the
    model's raw distribution: ``engine/sampling/logprobs.py``)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first
    rank: int | None = None  # 1 + tokens strictly more likely (prompt tokens' entries carry it)


@dataclass(frozen=True, slots=True)
class PromptScoring:
    """What a request asks the engine to score of its own prompt, teacher-forced from its prefill
    (``engine/sampling/prompt_scores.py``); the answers come in its ``FinishEvent``.

    ``top``: vLLM's ``prompt_logprobs``: for every prompt token but the first, its log-probability
    and rank under the distribution at the position before it, and that distribution's ``top``
    most likely tokens (0..MAX_LOGPROBS); None: not asked. ``full_rows``: the whole [vocab]
    log-probability rows of the distributions that predict the prompt's last ``full_rows``
    tokens (grounding scores: the answer tokens appended to a prompt)."""

    top: int | None = None
    full_rows: int = 0

    def __post_init__(self) -> None:
        if self.top is not None and not 0 <= self.top <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}")
        if self.full_rows < 0:
            raise ValueError("full_rows must be >= 0")


@dataclass(slots=True)
class TokenEvent:
    text: str  # new final text (may be empty while a stop string is pending)
    token_id: int
    logprob: TokenLogprob | None = None  # when the request asked for log-probabilities
    index: int = 0  # the choice (0..n-1) it belongs to


@dataclass(slots=True)
class FinishEvent:
    finish_reason: str  # "stop" | "length" | "cancelled"
    text: str
    prompt_tokens: int
    completion_tokens: int
    first_token_s: float | None  # seconds from arrival to the first token
    total_s: float
    first_logprobs: torch.Tensor | None = None  # [vocab] log-probabilities of the first token, if asked
    index: int = 0
    # PromptScoring's answers (None unless asked; with n > 1 only the choice that scored carries
    # them): one entry per prompt token from the second on, and [full_rows, vocab] float32 rows.
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_rows: torch.Tensor | None = None
    # Seconds from arrival to the first step that took the sequence (its wait in the queue); the
    # rest of first_token_s is its prefill: vision, the prompt's chunks and the first sample.
    queue_s: float | None = None


@dataclass(slots=True)
class ErrorEvent:
    error: BaseException
    index: int = 0


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
    scoring: PromptScoring | None = None  # score the prompt (one choice of an n > 1 request asks)
    index: int = 0  # which of the request's n choices this is
    # Shared by the n choices of one request (None when n = 1): the scheduler admits a choice
    # after its sibling's prefill, so that it takes the prompt's blocks from the prefix cache.
    group: object | None = None


def check_prompt_fits(prompt_tokens: int, limit: int) -> None:
    """400 for a prompt that leaves no room for one answer token within ``limit`` tokens per
    sequence; the message names the prompt, the one thing the client can shorten."""
    if prompt_tokens >= limit:
        raise InvalidRequest(
            f"the prompt has {prompt_tokens} tokens; this server's limit is {limit} tokens per sequence "
            "(prompt and answer together: --max-model-len, the KV-cache size or the model's context), which "
            "leaves no room for an answer. Shorten the prompt or send fewer or smaller images.",
            code="context_length_exceeded")


def default_max_tokens(prompt_tokens: int, limit: int) -> int:
    """The answer length of a request that sets none: what the per-sequence ``limit`` leaves
    after the prompt (vLLM's rule), so an omitted max_tokens is never the reason for a refusal."""
    check_prompt_fits(prompt_tokens, limit)
    return limit - prompt_tokens


def check_fits_context(prompt: EncodedPrompt, params: SamplingParams, model_context: int,
                       server_limit: int | None = None) -> None:
    """400 up front for a request that can never finish: a prompt with no room for an answer,
    or prompt + max_tokens beyond the model's context or beyond what this server holds per
    sequence (``server_limit``)."""
    check_prompt_fits(len(prompt.input_ids), min(model_context, server_limit or model_context))
    need = len(prompt.input_ids) + params.max_tokens
    head = f"the prompt has {len(prompt.input_ids)} tokens and max_tokens is {params.max_tokens}: {need} tokens exceed"
    if need > model_context:
        raise InvalidRequest(f"{head} the model's context of {model_context}. Lower max_tokens or shorten the prompt.",
                             code="context_length_exceeded", param="max_tokens")
    if server_limit is not None and need > server_limit:
        raise InvalidRequest(
            f"{head} this server's limit of {server_limit} tokens per sequence (max_model_len or KV-cache size). "
            "Lower max_tokens or shorten the prompt.", code="context_length_exceeded", param="max_tokens")


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """400 for a ``logit_bias`` or ``stop_token_ids`` id outside the model's vocabulary."""
    for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"{name} names token id {bad[0]}, outside this model's vocabulary of {vocab_size} "
                                 f"ids (0..{vocab_size - 1}).", param=name)


class LoopMailbox:
    """Events from the engine thread to one asyncio loop, with one wake-up per burst.

    ``call_soon_threadsafe`` per event wakes the loop (a socket write) once per token of
    every request: at 256 running requests that is 256 wake-ups per step, and each makes
    the loop thread take the GIL from the engine. Here the engine thread appends to a deque
    and schedules one drain only when none is pending.
    """

    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox]] = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: collections.deque[tuple[Callable[[Event], None], Event]] = collections.deque()
        self.pending = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        """The loop's mailbox (call from the loop's own thread)."""
        box = cls._by_loop.get(loop)
        if box is None:
            box = cls._by_loop[loop] = cls(loop)
        return box

    def post(self, deliver: Callable[[Event], None], event: Event) -> None:
        """From any thread: ``deliver(event)`` will run on the loop."""
        self.items.append((deliver, event))
        if not self.pending:
            self.pending = True
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        # Cleared before draining: an item appended after this point either is drained
        # below or schedules a drain of its own.
        self.pending = False
        while self.items:
            deliver, event = self.items.popleft()
            deliver(event)


def overloaded(max_queue: int | None) -> Overloaded:
    """The 429 for a request that finds the queue full."""
    return Overloaded(f"{max_queue} requests are already waiting; retry shortly.")


def enqueue(work_queue: queue.Queue[EngineRequest | None], max_queue: int | None, prompt: EncodedPrompt,
            params: SamplingParams, request_id: str | None, want_first_logprobs: bool,
            scoring: PromptScoring | None, emit: Callable[[Event], None]) -> threading.Event:
    """Put a request's ``params.n`` choices on the worker's queue, or none (429 ``Overloaded`` when
    it is full); ``emit`` gets every choice's events, on the engine's thread, each with its
    ``index``. Returns the flag that cancels them all."""
    rid = request_id or uuid.uuid4().hex
    n = params.n
    cancelled = threading.Event()
    group = object() if n > 1 else None

    def emitter(index: int) -> Callable[[Event], None]:
        def emit_one(event: Event) -> None:
            event.index = index
            emit(event)
        return emit_one

    requests = [EngineRequest(request_id=rid if n == 1 else f"{rid}-{i}", prompt=prompt,
                              params=params if n == 1 else params.choice(i), emit=emitter(i),
                              cancelled=cancelled, want_first_logprobs=want_first_logprobs, index=i,
                              group=group, scoring=scoring if i == 0 else None)
                for i in range(n)]
    try:
        for request in requests:
            work_queue.put_nowait(request)
    except queue.Full:
        cancelled.set()  # the choices already queued are dropped by the worker
        raise overloaded(max_queue) from None
    return cancelled


class Submission:
    """One request put on an engine worker's queue, and its events as they come back.

    Constructing it queues the request or refuses it at once (429 ``Overloaded``): a caller that
    streams over HTTP submits before the response starts, so a request that will not be queued
    is never a 200 whose stream stops. With ``params.n`` > 1 the request is n engine requests,
    one per choice (``params.choice(i)``), whose events carry their ``index``; a ``scoring`` of the
    prompt is asked of choice 0 alone (the prompt is scored once; choices after it take its
    blocks from the prefix cache), and only its ``FinishEvent`` carries it; ``events`` ends
    when every choice has finished, or at the first error (the other choices are then
    cancelled). ``cancel`` (also run when ``events`` stops early) makes the worker drop the
    request or free its KV blocks at the next step.
    """

    def __init__(self, work_queue: queue.Queue[EngineRequest | None], max_queue: int | None,
                 prompt: EncodedPrompt, params: SamplingParams, request_id: str | None,
                 want_first_logprobs: bool, scoring: PromptScoring | None = None) -> None:
        mailbox = LoopMailbox.of(asyncio.get_running_loop())
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.n = params.n
        self.cancelled = enqueue(work_queue, max_queue, prompt, params, request_id, want_first_logprobs, scoring,
                                 lambda event: mailbox.post(self._events.put_nowait, event))

    def cancel(self) -> None:
        self.cancelled.set()  # no-op when finished

    async def accepted(self) -> None:
        """Queued already (a refusal raised in the constructor); the engine core's client waits here."""

    async def events(self) -> AsyncIterator[Event]:
        finished = 0
        try:
            while True:
                event = await self._events.get()
                yield event
                if isinstance(event, ErrorEvent):
                    return
                if isinstance(event, FinishEvent):
                    finished += 1
                    if finished == self.n:
                        return
        finally:
            self.cancel()
