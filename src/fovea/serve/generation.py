"""Run an encoded prompt through the engine and answer as JSON or as a server-sent stream."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, StreamingResponse

from fovea.engine.core.request import (
    ErrorEvent,
    FinishEvent,
    PromptScoring,
    Submission,
    TokenEvent,
    TokenLogprob,
    default_max_tokens,
)
from fovea.engine.sampling.params import SamplingParams
from fovea.engine.structured.spec import GrammarSpec
from fovea.errors import FoveaError, InvalidRequest
from fovea.guard.canary import KL_FLOOR
from fovea.guard.grounding import answer_dependence
from fovea.loading.prompt import EncodedPrompt
from fovea.serve import protocol
from fovea.serve.event_stream import EventStream, sse
from fovea.serve.logprobs_format import LogprobFormatter, prompt_logprobs
from fovea.serve.protocol import SamplingFields
from fovea.serve.state import ServerState
from fovea.serve.structured import compile_request_grammar

log = logging.getLogger("fovea.request")


class EngineFailure(FoveaError):
    status, code, type = 500, "engine_error", "server_error"


def failure(error: BaseException) -> FoveaError:
    """What the client is told when the engine ends a request with ``error``: the error itself
    when it is one of fovea's (its own code: out_of_memory, image_placeholder_mismatch, ...),
    else a generic engine error."""
    if isinstance(error, FoveaError):
        return error
    return EngineFailure(f"generation failed: {type(error).__name__}: {error}")


def sampling_params(state: ServerState, req: SamplingFields, prompt: EncodedPrompt) -> SamplingParams:
    # Unset: what the server's per-sequence limit leaves after the prompt (refused only when the
    # prompt itself leaves nothing), never the model's context, which --max-model-len may undercut.
    max_tokens = req.max_completion_tokens or req.max_tokens or \
        default_max_tokens(len(prompt.input_ids), state.engine.max_context)
    if req.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({req.min_tokens}) is larger than max_tokens ({max_tokens}).",
                             param="min_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=state.default_temperature if req.temperature is None else req.temperature,
        top_p=state.default_top_p if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=list(req.stop or []),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        n=req.n,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=req.logit_bias_ids(),
        stop_token_ids=list(req.stop_token_ids or []),
        logprobs=req.top_logprobs_wanted(),
    )


def timing_report(state: ServerState, prompt: EncodedPrompt, finish: FinishEvent) -> dict:
    """``fovea.timing``: what this request's images cost the vision stage (engine/vision/vision_timings.py)
    and how fast its answer came."""
    vision = state.engine.encoder_cache.timings.report(prompt) or {"encoder_ms": None, "images_encoded": 0,
                                                                    "images_cached": 0}
    decode_s = finish.total_s - (finish.first_token_s or 0.0)
    rate = (finish.completion_tokens - 1) / decode_s if finish.completion_tokens > 1 and decode_s > 0 else None
    first = None if finish.first_token_s is None else round(1000 * finish.first_token_s, 3)
    queue = None if finish.queue_s is None else round(1000 * finish.queue_s, 3)
    prefill = None if first is None or queue is None else round(max(0.0, first - queue), 3)
    return {**vision, "queue_ms": queue, "prefill_ms": prefill, "first_token_ms": first,
            "total_ms": round(1000 * finish.total_s, 3),
            "completion_tokens": finish.completion_tokens,
            "decode_tokens_per_s": None if rate is None else round(rate, 2)}


def log_finish(state: ServerState, prompt: EncodedPrompt, finish: FinishEvent, completion_id: str) -> None:
    """The numbers the metrics observed for this request, on one line with its request id (fovea.logs)."""
    if not log.isEnabledFor(logging.INFO):
        return
    timing = timing_report(state, prompt, finish)
    log.info("%s %s: %d prompt + %d completion tokens, first token %s ms, encoder %s ms", completion_id,
             finish.finish_reason, finish.prompt_tokens, finish.completion_tokens, timing["first_token_ms"],
             timing["encoder_ms"], extra={"completion_id": completion_id, "finish_reason": finish.finish_reason,
                                          "prompt_tokens": finish.prompt_tokens, **timing})


def extension(state: ServerState, req: SamplingFields, prompt: EncodedPrompt, finish: FinishEvent) -> dict:
    return {"timing": timing_report(state, prompt, finish)} if req.fovea and req.fovea.timing else {}


async def grounding_report(state: ServerState, prompt: EncodedPrompt, twin: EncodedPrompt | None,
                           answer: str, rid: str | None = None) -> dict:
    """The answer scored by the engine with the request's images and with blank ones (guard/grounding.py)."""
    if twin is None:
        return {"image_dependent": None, "note": "the request carries no image"}
    threshold = state.canary.threshold or KL_FLOOR
    return await answer_dependence(state.engine, state.loaded, prompt, twin, answer, threshold,
                                   request_id=f"{rid}-grounding" if rid else None)


class Format:
    """How one endpoint shapes its answers: chat messages/deltas or plain text completions."""

    def __init__(self, kind: str) -> None:
        self.kind = kind  # "chat" | "text"

    def choice(self, index: int, finish: FinishEvent, logprobs: dict | None) -> dict:
        build = protocol.chat_choice if self.kind == "chat" else protocol.text_choice
        return build(index, finish.text, finish.finish_reason, logprobs)

    def response(self, rid, model, choices: list[dict], usage: dict, extra) -> dict:
        build = protocol.chat_response if self.kind == "chat" else protocol.text_response
        return build(rid, model, choices, usage, extra)

    def first(self, rid, model, created, index: int = 0) -> dict | None:
        return protocol.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}, index=index) \
            if self.kind == "chat" else None

    def on_text(self, rid, model, created, text: str, index: int = 0, logprobs: dict | None = None) -> list[dict]:
        """The chunks for new answer text (a tool-call format may hold text back)."""
        if not text and logprobs is None:
            return []
        return [self.delta(rid, model, created, text, index=index, logprobs=logprobs)]

    def on_finish(self, rid, model, created, finish_reason: str, index: int = 0) -> list[dict]:
        """The chunks that end a choice; the last one carries the finish reason."""
        return [self.delta(rid, model, created, "", finish_reason, index=index)]

    def delta(self, rid, model, created, text: str, finish_reason: str | None = None, index: int = 0,
              logprobs: dict | None = None) -> dict:
        if self.kind == "chat":
            return protocol.chat_chunk(rid, model, created, {"content": text} if text else {}, finish_reason,
                                       index, logprobs)
        return protocol.text_chunk(rid, model, created, text, finish_reason, index, logprobs)


CHAT, TEXT = Format("chat"), Format("text")


@dataclass
class Answer:
    """One choice's end and, when asked, its tokens' log-probabilities."""

    finish: FinishEvent
    logprobs: list[TokenLogprob] = field(default_factory=list)


async def run_choices(state: ServerState, prompt: EncodedPrompt, params: SamplingParams, rid: str,
                      want_first_logprobs: bool = False, scoring: PromptScoring | None = None) -> list[Answer]:
    """Every choice (``params.n``), in index order; ``scoring``: the prompt's, on choice 0's finish."""
    events = state.engine.generate(prompt, params, rid, want_first_logprobs=want_first_logprobs, scoring=scoring)
    return await collect_choices(state, prompt, events, params.n, rid)


async def collect_choices(state: ServerState, prompt: EncodedPrompt, events: AsyncIterator, n: int,
                          rid: str) -> list[Answer]:
    """The ``n`` choices that ``events`` end, in index order (the first error is raised)."""
    finishes: dict[int, FinishEvent] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    async for event in events:
        if isinstance(event, TokenEvent):
            if event.logprob is not None:
                logprobs.setdefault(event.index, []).append(event.logprob)
        elif isinstance(event, FinishEvent):
            finishes[event.index] = event
            state.metrics.observe_finish(event)
            log_finish(state, prompt, event, rid)
        elif isinstance(event, ErrorEvent):
            raise failure(event.error)  # a 5xx (or the error's own status) with a JSON body
    assert len(finishes) == n
    return [Answer(finishes[i], logprobs.get(i, [])) for i in range(n)]


async def run_to_finish(state: ServerState, prompt: EncodedPrompt, params: SamplingParams, rid: str,
                        want_first_logprobs: bool = False) -> FinishEvent:
    """The one choice of an n = 1 request."""
    return (await run_choices(state, prompt, params, rid, want_first_logprobs))[0].finish


def total_usage(finishes: list[FinishEvent], per_prompt: int | None = None) -> dict:
    """Each prompt counted once (its choices share its blocks), every choice's tokens; a batch of
    prompts (completions) has ``per_prompt`` choices for each, indexed prompt by prompt."""
    per = per_prompt or len(finishes)
    prompts = {f.index // per: f.prompt_tokens for f in finishes}
    return protocol.usage(sum(prompts.values()), sum(f.completion_tokens for f in finishes))


async def respond(state: ServerState, req: SamplingFields, prompt: EncodedPrompt,
                  blank_twin: EncodedPrompt | None = None, fmt: Format = CHAT,
                  grammar: GrammarSpec | None = None) -> JSONResponse | StreamingResponse:
    """``blank_twin`` (the prompt with blank images) asks for a per-request grounding score;
    ``grammar``: one the endpoint adds (tool calls), beside the request's structured-output fields."""
    params = sampling_params(state, req, prompt)
    state.engine.check_fits(prompt, params)  # 400 before any streaming starts
    params.grammar = await compile_request_grammar(state, req, grammar)  # structured outputs (None: free text)
    rid = protocol.completion_id("chatcmpl" if fmt.kind == "chat" else "cmpl")
    grounding = bool(req.fovea and req.fovea.grounding)
    if grounding and params.n > 1:
        raise InvalidRequest("fovea.grounding scores one answer; send n=1 with it.", param="n")
    twin = blank_twin if grounding else None
    if req.stream:
        submission = state.engine.submit(prompt, params, rid)  # refused (429) here, before the stream's 200
        await submission.accepted()  # (or here, by a separate engine core)
        return event_stream(state, req, [prompt], params, rid, submission, fmt, grounding, twin)
    answers = await run_choices(state, prompt, params, rid, scoring=req.prompt_scoring())
    finishes = [a.finish for a in answers]
    extra = extension(state, req, prompt, finishes[0])
    if grounding:
        extra["grounding"] = await grounding_report(state, prompt, twin, finishes[0].text, rid)
    choices = [fmt.choice(i, a.finish, None if params.logprobs is None else
                          LogprobFormatter(state.loaded.tokenizer, fmt.kind).format(a.logprobs))
               for i, a in enumerate(answers)]
    body = fmt.response(rid, state.model_name, choices, total_usage(finishes), extra or None)
    if req.prompt_logprobs is not None:
        add_prompt_logprobs(state, body, fmt, [answers[0].finish], params.n)
    return JSONResponse(body)


def add_prompt_logprobs(state: ServerState, body: dict, fmt: Format, scored: list[FinishEvent], n: int) -> None:
    """vLLM's places: chat's on the response, completions' on every choice (the ``n`` choices of
    each prompt share its list; ``scored`` holds each prompt's choice that scored it)."""
    lists = [prompt_logprobs(state.loaded.tokenizer, finish.prompt_logprobs or []) for finish in scored]
    if fmt.kind == "chat":
        body["prompt_logprobs"] = lists[0]
        return
    for i, choice in enumerate(body["choices"]):
        choice["prompt_logprobs"] = lists[i // n]


def event_stream(state: ServerState, req: SamplingFields, prompts: list[EncodedPrompt], params: SamplingParams,
                 rid: str, submission: Submission, fmt: Format, grounding: bool = False,
                 twin: EncodedPrompt | None = None) -> EventStream:
    """The streamed answer of a request the engine has admitted: ``prompts`` is its prompt, or a
    completions batch's (``params.n`` choices over them all, ``submission`` their events)."""
    options = req.stream_options
    usage = StreamUsage(params.n, bool(options and options.include_usage),
                        bool(options and options.include_usage and options.continuous_usage_stats),
                        [len(p.input_ids) for p in prompts])
    return EventStream(_stream(state, req, prompts[0], params, rid, submission, usage, grounding, twin, fmt),
                       on_close=submission.cancel)


class StreamUsage:
    """``stream_options``: ``include_usage`` adds a last chunk with the usage; with
    ``continuous_usage_stats`` too (vLLM) every chunk carries the usage so far, the completion
    tokens summed over the choices. ``prompts``: each prompt's tokens (a completions batch has
    several, ``n // len(prompts)`` choices each)."""

    def __init__(self, n: int, final: bool, continuous: bool, prompts: list[int]) -> None:
        self.final, self.continuous = final, continuous
        self.prompts = list(prompts)
        self.per_prompt = n // len(prompts)
        self.completion = [0] * n

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompts)

    def on_token(self, event: TokenEvent) -> None:
        if event.token_id >= 0:  # a flush of held-back text is no token
            self.completion[event.index] += 1

    def on_finish(self, event: FinishEvent) -> None:
        self.prompts[event.index // self.per_prompt] = event.prompt_tokens
        self.completion[event.index] = event.completion_tokens  # the engine's own count wins

    def stamp(self, chunk: dict) -> dict:
        if self.continuous:
            chunk["usage"] = protocol.usage(self.prompt_tokens, sum(self.completion))
        return chunk


async def _stream(state: ServerState, req: SamplingFields, prompt: EncodedPrompt, params: SamplingParams, rid: str,
                  submission: Submission, usage: StreamUsage, grounding: bool, twin: EncodedPrompt | None,
                  fmt: Format) -> AsyncIterator[str]:
    """Each chunk names its choice; a chunk carries the log-probabilities of the token whose text
    it carries (a token whose text is held back for a stop string gets a chunk of its own).

    The stream began with 200: whatever fails from here on ends it with an OpenAI-style error
    event and ``[DONE]``, and no chunk carries a finish_reason, so a cut answer never looks finished."""
    try:
        async with aclosing(_chunks(state, req, prompt, params, rid, submission, usage, grounding, twin,
                                    fmt)) as chunks:
            async for chunk in chunks:
                yield sse(chunk)
    except Exception as exc:
        error = failure(exc)
        if not isinstance(exc, FoveaError):
            log.exception("%s: the stream failed after it began", rid)
        state.metrics.observe_error_code(error.code)
        yield sse(error.to_body())
    yield sse("[DONE]")


async def _chunks(state: ServerState, req: SamplingFields, prompt: EncodedPrompt, params: SamplingParams, rid: str,
                  submission: Submission, usage: StreamUsage, grounding: bool, twin: EncodedPrompt | None,
                  fmt: Format) -> AsyncIterator[dict | str]:
    """The stream's chunks, in order; an error event (a dict with ``error``) is passed as it is."""
    created, model = int(time.time()), state.model_name
    formatters = [LogprobFormatter(state.loaded.tokenizer, fmt.kind) for _ in range(params.n)] \
        if params.logprobs is not None else None
    for index in range(params.n):
        first = fmt.first(rid, model, created, index)
        if first is not None:
            yield usage.stamp(first)
    finishes: list[FinishEvent] = []
    async with aclosing(submission.events()) as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                usage.on_token(event)
                logprobs = formatters[event.index].format([event.logprob]) \
                    if formatters is not None and event.logprob is not None else None
                for chunk in fmt.on_text(rid, model, created, event.text, event.index, logprobs):
                    yield usage.stamp(chunk)
            elif isinstance(event, FinishEvent):
                usage.on_finish(event)
                state.metrics.observe_finish(event)
                log_finish(state, prompt, event, rid)
                try:
                    *before, last = fmt.on_finish(rid, model, created, event.finish_reason, event.index)
                except FoveaError as error:  # streamed tool-call pieces that are no call: never a wrong one
                    state.metrics.observe_error_code(error.code)
                    yield error.to_body()
                    continue
                for chunk in before:
                    yield usage.stamp(chunk)
                extra = extension(state, req, prompt, event)
                if grounding:
                    extra["grounding"] = await grounding_report(state, prompt, twin, event.text, rid)
                if extra:
                    last["fovea"] = extra
                yield usage.stamp(last)
                finishes.append(event)
                if usage.final and len(finishes) == params.n:
                    chunk = fmt.delta(rid, model, created, "")
                    chunk["choices"] = []
                    chunk["usage"] = total_usage(finishes, usage.per_prompt)
                    yield chunk
            elif isinstance(event, ErrorEvent):
                raise failure(event.error)
