"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}.

The input becomes the same chat-template prompt and goes through the same image path as
/v1/chat/completions (``load_image_bytes``: the sources, limits and error codes of chat's
``image_url`` parts); only the shapes around it differ. Function tools are chat's, in the
Responses shapes (serve/responses/tools.py); the output items, log-probabilities included, are
built as the tokens arrive (serve/responses/output.py). A response is kept only when asked
(``store: true``), in a bounded store (serve/responses/store.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from fovea.engine.core.request import ErrorEvent, FinishEvent, Submission, TokenEvent
from fovea.engine.sampling.params import SamplingParams
from fovea.errors import FoveaError, InvalidRequest
from fovea.loading.prompt import EncodedPrompt, render_chat
from fovea.media.errors import ImageNotFound
from fovea.media.store import is_image_id
from fovea.models.base import EncodeOptions
from fovea.serve.chat import (
    check_model_name,
    load_image_bytes,
    refuse_typed_placeholder,
    refuse_typed_video_token,
)
from fovea.serve.event_stream import EventStream
from fovea.serve.fields import UnsupportedParameter
from fovea.serve.generation import failure, log_finish, sampling_params
from fovea.serve.logprobs_format import LogprobFormatter
from fovea.serve.protocol import SamplingFields
from fovea.serve.responses.api import (
    EventWriter,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    ResponsesRequest,
    new_id,
    response_object,
)
from fovea.serve.responses.output import ResponseOutput
from fovea.serve.responses.store import ResponseStore, Turn
from fovea.serve.responses.tools import call_turn, check_tool_turns, output_turn, tool_request
from fovea.serve.state import ServerState
from fovea.serve.structured import compile_spec, refuse_with_tools, text_format_grammar
from fovea.serve.tools.calls import call_grammar, template_call

log = logging.getLogger("fovea.request")

FROM_PREVIOUS = "previous_response_id"  # the request path named for a refusal in a stored turn


def input_turns(req: ResponsesRequest) -> list[Turn]:
    """The request's input as conversation turns; each part keeps its request path in ``where``."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": [{"type": "text", "text": req.input, "where": "input"}]}]
    turns: list[Turn] = []
    for i, message in enumerate(req.input):
        if isinstance(message, FunctionCallItem):
            call_turn(turns, message, f"input[{i}]")
            continue
        if isinstance(message, FunctionCallOutputItem):
            turns.append(output_turn(message, f"input[{i}]"))
            continue
        if isinstance(message.content, str):
            turns.append({"role": message.role, "content": [{"type": "text", "text": message.content,
                                                             "where": f"input[{i}].content"}]})
            continue
        parts = []
        for j, part in enumerate(message.content):
            where = f"input[{i}].content[{j}]"
            if isinstance(part, InputImage):
                if message.role != "user":
                    raise InvalidRequest(f"input[{i}] is a {message.role} message; images may only be sent in user "
                                         "messages.", param=where)
                parts.append({"type": "image", "ref": image_ref(part, where), "where": where,
                              "low": part.detail == "low"})
            else:
                parts.append({"type": "text", "text": part.text, "where": f"{where}.text"})
        turns.append({"role": message.role, "content": parts})
    return turns


def low_detail(turns: list[Turn]) -> tuple[bool, ...]:
    """Per image, in the order template_messages collects them: sent with detail "low"."""
    return tuple(bool(part.get("low")) for turn in turns if isinstance(turn.get("content"), list)
                 for part in turn["content"] if part.get("type") == "image")


def image_ref(part: InputImage, where: str) -> str:
    if (part.image_url is None) == (part.file_id is None):
        raise InvalidRequest(f"{where} must carry exactly one of image_url and file_id.", param=where)
    if part.file_id is not None and not is_image_id(part.file_id):
        raise ImageNotFound(f"file_id {part.file_id[:80]!r} is not an image uploaded to this server: fovea's file ids "
                            "are the img-... ids that POST /v1/images returns.", param=f"{where}.file_id")
    return part.file_id or part.image_url  # type: ignore[return-value]


def template_messages(state: ServerState, instructions: str | None, turns: list[Turn]
                      ) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """transformers-style messages plus the (image reference, request path) of each image."""
    image_token = state.loaded.image_token
    messages: list[dict[str, Any]] = []
    if instructions:
        refuse_typed_placeholder(instructions, image_token, "instructions")
        refuse_typed_video_token(state, instructions, "instructions")
        messages.append({"role": "system", "content": instructions})
    refs: list[tuple[str, str]] = []
    for turn in turns:
        parts: list[dict[str, Any]] = []
        for part in turn["content"]:
            where = part.get("where", FROM_PREVIOUS)
            if part["type"] == "image":
                refs.append((part["ref"], where))
                parts.append({"type": "image"})
            else:
                refuse_typed_placeholder(part["text"], image_token, where)
                refuse_typed_video_token(state, part["text"], where)
                parts.append({"type": "text", "text": part["text"]})
        one_text = len(parts) == 1 and parts[0]["type"] == "text"
        message = {"role": turn["role"], "content": parts[0]["text"] if one_text else parts}
        if turn.get("tool_calls"):
            for call in turn["tool_calls"]:  # rendered into the prompt as the arguments' JSON
                refuse_typed_placeholder(call["arguments"], image_token, call.get("where", FROM_PREVIOUS))
                refuse_typed_video_token(state, call["arguments"], call.get("where", FROM_PREVIOUS))
            message["tool_calls"] = [template_call(c["id"], c["name"], c["arguments"], c.get("where", FROM_PREVIOUS))
                                     for c in turn["tool_calls"]]
        if "tool_call_id" in turn:
            message["tool_call_id"] = turn["tool_call_id"]
        messages.append(message)
    return messages, refs


def _without_paths(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in p.items() if k != "where"} for p in parts]


def stored_turns(turns: list[Turn]) -> list[Turn]:
    """Turns as the store keeps them: without this request's paths."""
    out = []
    for t in turns:
        turn = {**t, "content": _without_paths(t["content"])}
        if "tool_calls" in t:
            turn["tool_calls"] = _without_paths(t["tool_calls"])
        out.append(turn)
    return out


def answer_turn(output: list[dict[str, Any]]) -> Turn:
    """The answer as the store keeps it: its text and its calls, one assistant turn."""
    turn: Turn = {"role": "assistant", "content": [{"type": "text", "text": part["text"]} for item in output
                                                   if item["type"] == "message" for part in item["content"]]}
    calls = [{"id": i["call_id"], "name": i["name"], "arguments": i["arguments"]} for i in output
             if i["type"] == "function_call"]
    if calls:
        turn["tool_calls"] = calls
    return turn


def remap_max_tokens(error: FoveaError) -> FoveaError:
    if error.param == "max_tokens":  # the engine's name for this endpoint's max_output_tokens
        error.param = "max_output_tokens"
        error.message = error.message.replace("max_tokens", "max_output_tokens")
    return error


def make_responses_router(state: ServerState, store: ResponseStore | None = None) -> APIRouter:
    router = APIRouter()
    store = store if store is not None else ResponseStore()

    @router.post("/v1/responses")
    async def create(req: ResponsesRequest):
        check_model_name(state, req.model)
        state.engine.refuse_when_full()  # before its images are fetched and decoded
        history = store.get(req.previous_response_id, FROM_PREVIOUS).conversation if req.previous_response_id else []
        turns = [*history, *input_turns(req)]
        check_tool_turns(state.loaded, turns)
        tools = tool_request(req, state.loaded)
        if req.store:
            store.check_fits(turns)
        messages, refs = template_messages(state, req.instructions, turns)
        images = await load_image_bytes(state, refs)
        text = render_chat(state.loaded, messages, tools and tools.tools)
        prompt, _ = await state.preprocessor.prompts(text, images, options=EncodeOptions(low_detail=low_detail(turns)))
        params = sampling_params(state, SamplingFields(max_tokens=req.max_output_tokens, temperature=req.temperature,
                                                       top_p=req.top_p), prompt)
        params.logprobs = (req.top_logprobs or 0) if req.wants_logprobs else None
        spec = text_format_grammar(req.text)
        if tools is not None:
            refuse_with_tools(spec)
            spec = call_grammar(tools)
        params.grammar = await compile_spec(state, spec)  # None: free text
        try:
            state.engine.check_fits(prompt, params)  # 400 before any streaming starts
        except FoveaError as exc:
            raise remap_max_tokens(exc) from None
        # Where the grammar enforces the calls, a stream sends their arguments as they are written.
        run = Run(state, store, req, turns, params, tools is not None, bool(req.stream) and tools is not None
                  and spec is not None)
        if req.stream:
            submission = state.engine.submit(prompt, params, run.rid)  # a 429 comes here, before the 200
            await submission.accepted()  # (or here, by a separate engine core)
            return EventStream(run.stream(prompt, submission), on_close=submission.cancel)
        return JSONResponse(await run.collect(prompt))

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        for name in request.query_params:  # include, stream, starting_after, include_obfuscation
            raise UnsupportedParameter(f"GET /v1/responses/{{id}} takes no query parameters here; {name!r} is not "
                                       "supported (fovea has no background responses to stream again).", param=name)
        return JSONResponse(store.get(response_id).body)

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


class Run:
    """One response being made: its ids, the settings it echoes, its output as it is built, and
    what it stores at the end."""

    def __init__(self, state: ServerState, store: ResponseStore, req: ResponsesRequest, turns: list[Turn],
                 params: SamplingParams, tools: bool, incremental: bool = False) -> None:
        self.state, self.store, self.req, self.turns = state, store, req, turns
        self.rid, self.created = new_id("resp"), time.time()
        self.temperature, self.top_p = params.temperature, params.top_p
        self.params = params
        formatter = LogprobFormatter(state.loaded.tokenizer, "chat") if params.logprobs is not None else None
        self.output = ResponseOutput(new_id("msg"), tools, formatter, incremental)

    def body(self, **kw: Any) -> dict[str, Any]:
        return response_object(self.rid, self.req, self.state.model_name, self.created, self.temperature,
                               self.top_p, **kw)

    def finished(self, finish: FinishEvent) -> dict[str, Any]:
        """The final Response object (after ``output.on_finish``); stored when asked."""
        status = "completed" if finish.finish_reason == "stop" else "incomplete"
        body = self.body(status=status, output=self.output.items, usage=(finish.prompt_tokens, finish.completion_tokens))
        if self.req.store:
            self.store.put(self.rid, body, [*stored_turns(self.turns), answer_turn(self.output.items)])
        return body

    async def events(self, prompt: EncodedPrompt, submission: Submission | None = None
                     ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """The stream's events after response.in_progress; the last is the final Response's.
        ``submission``: the request already on the engine's queue (None: it is submitted here)."""
        state = self.state
        submission = submission or state.engine.submit(prompt, self.params, self.rid)
        for item in self.output.start():
            yield item
        # Closed at once when the consumer stops (a client gone): the engine cancels the request.
        async with aclosing(submission.events()) as updates:
            async for update in updates:
                if isinstance(update, TokenEvent):
                    for item in self.output.on_token(update):
                        yield item
                elif isinstance(update, FinishEvent):
                    state.metrics.observe_finish(update)
                    log_finish(state, prompt, update, self.rid)
                    for item in self.output.on_finish(update):
                        yield item
                    body = self.finished(update)
                    yield f"response.{body['status']}", {"response": body}  # completed | incomplete
                elif isinstance(update, ErrorEvent):
                    raise failure(update.error)

    async def collect(self, prompt: EncodedPrompt) -> dict[str, Any]:
        """The non-streamed answer: the same events, only the last one kept."""
        last: dict[str, Any] = {}
        async with aclosing(self.events(prompt)) as events:
            async for _, fields in events:
                last = fields
        return last["response"]

    async def stream(self, prompt: EncodedPrompt, submission: Submission) -> AsyncIterator[str]:
        event = EventWriter()
        yield event("response.created", response=self.body())
        yield event("response.in_progress", response=self.body())
        try:
            async with aclosing(self.events(prompt, submission)) as events:
                async for kind, fields in events:
                    yield event(kind, **fields)
        except Exception as exc:
            # The stream began with 200: it ends with an error event and response.failed, and
            # no response.completed, so a cut answer never looks finished.
            error = failure(exc)
            if not isinstance(exc, FoveaError):
                log.exception("%s: the stream failed after it began", self.rid)
            self.state.metrics.observe_error_code(error.code)
            yield event("error", code=error.code, message=error.message, param=error.param)
            yield event("response.failed", response=self.body(
                status="failed", error={"code": error.code, "message": error.message}))
