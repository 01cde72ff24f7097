"""Run an encoded prompt through the engine and answer as JSON or as a server-sent stream."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import torch
from fastapi.responses import JSONResponse, StreamingResponse

from fovea.engine.request import ErrorEvent, FinishEvent, TokenEvent
from fovea.engine.sampling import SamplingParams
from fovea.errors import FoveaError
from fovea.guard.canary import KL_FLOOR, kl_divergence
from fovea.model.prompt import EncodedPrompt
from fovea.serve import protocol
from fovea.serve.protocol import SamplingFields
from fovea.serve.state import ServerState


class EngineFailure(FoveaError):
    status, code, type = 500, "engine_error", "server_error"


def sampling_params(state: ServerState, req: SamplingFields, prompt: EncodedPrompt) -> SamplingParams:
    room = state.loaded.context_length - len(prompt.input_ids)
    max_tokens = req.max_completion_tokens or req.max_tokens or max(1, room)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=state.default_temperature if req.temperature is None else req.temperature,
        top_p=state.default_top_p if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=list(req.stop or []),
    )


async def blank_first_logprobs(state: ServerState, twin: EncodedPrompt) -> torch.Tensor:
    """First-token log-probabilities of the same prompt with every image replaced by a blank one."""
    async for event in state.engine.generate(twin, SamplingParams(max_tokens=1, temperature=0.0),
                                             want_first_logprobs=True):
        if isinstance(event, FinishEvent) and event.first_logprobs is not None:
            return event.first_logprobs
        if isinstance(event, ErrorEvent):
            raise EngineFailure(f"grounding ablation failed: {event.error}")
    raise EngineFailure("grounding ablation produced no distribution")


def grounding_report(state: ServerState, real: torch.Tensor | None, blank: torch.Tensor | None) -> dict:
    if real is None or blank is None:
        return {"first_token_kl": None, "image_dependent": None, "note": "the request carries no image"}
    kl = kl_divergence(real, blank)
    threshold = state.canary.threshold or KL_FLOOR
    return {"first_token_kl": round(kl, 6), "threshold": round(threshold, 6), "image_dependent": kl > threshold}


async def respond(state: ServerState, req: SamplingFields, prompt: EncodedPrompt,
                  blank_twin: EncodedPrompt | None = None) -> JSONResponse | StreamingResponse:
    """``blank_twin`` (the prompt with blank images) asks for a per-request grounding score."""
    params = sampling_params(state, req, prompt)
    state.engine.check_fits(prompt, params)  # 400 before any streaming starts
    rid = protocol.completion_id()
    grounding = bool(req.fovea and req.fovea.grounding)
    blank = await blank_first_logprobs(state, blank_twin) if (grounding and blank_twin is not None) else None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(state, prompt, params, rid, include_usage, grounding, blank),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    finish = None
    async for event in state.engine.generate(prompt, params, rid, want_first_logprobs=grounding):
        if isinstance(event, FinishEvent):
            finish = event
        elif isinstance(event, ErrorEvent):
            raise EngineFailure(f"generation failed: {type(event.error).__name__}: {event.error}")
    assert finish is not None
    state.metrics.observe_finish(finish.first_token_s, finish.total_s, finish.completion_tokens)
    extra = {"grounding": grounding_report(state, finish.first_logprobs, blank)} if grounding else None
    return JSONResponse(protocol.chat_response(rid, state.model_name, finish.text, finish.finish_reason,
                                               finish.prompt_tokens, finish.completion_tokens, extra))


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


async def _stream(state: ServerState, prompt: EncodedPrompt, params: SamplingParams, rid: str,
                  include_usage: bool, grounding: bool, blank: torch.Tensor | None) -> AsyncIterator[str]:
    created, model = int(time.time()), state.model_name
    yield _sse(protocol.chat_chunk(rid, model, created, {"role": "assistant", "content": ""}))
    async for event in state.engine.generate(prompt, params, rid, want_first_logprobs=grounding):
        if isinstance(event, TokenEvent):
            if event.text:
                yield _sse(protocol.chat_chunk(rid, model, created, {"content": event.text}))
        elif isinstance(event, FinishEvent):
            state.metrics.observe_finish(event.first_token_s, event.total_s, event.completion_tokens)
            last = protocol.chat_chunk(rid, model, created, {}, event.finish_reason)
            if grounding:
                last["fovea"] = {"grounding": grounding_report(state, event.first_logprobs, blank)}
            yield _sse(last)
            if include_usage:
                chunk = protocol.chat_chunk(rid, model, created, {})
                chunk["choices"] = []
                chunk["usage"] = protocol.usage(event.prompt_tokens, event.completion_tokens)
                yield _sse(chunk)
        elif isinstance(event, ErrorEvent):
            failure = EngineFailure(f"generation failed: {type(event.error).__name__}: {event.error}")
            yield _sse(failure.to_body())
    yield _sse("[DONE]")
