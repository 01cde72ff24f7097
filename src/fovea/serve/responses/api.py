"""The request schema of POST /v1/responses and the shapes of its answers (objects and stream events)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fovea.engine.sampling.params import MAX_LOGPROBS
from fovea.errors import InvalidRequest
from fovea.serve.fields import UnsupportedParameter
from fovea.serve.responses import fields as responses_fields
from fovea.serve.responses.fields import LOGPROBS_INCLUDE


class _Strict(BaseModel):
    # A key inside an item or a part that fovea does not take is a 400 unsupported_parameter
    # naming its path, as in chat's messages (docs/api.md, "Nested keys").
    model_config = ConfigDict(extra="forbid")


class _OutputItem(_Strict):
    # An earlier response's output items sent back as input (`input += response.output`, as
    # OpenAI's guides do) carry their id and status: accepted, no effect.
    id: str | None = None
    status: str | None = None


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    """An earlier answer sent back as input (an assistant message's content); its annotations
    and log-probabilities describe that answer and change nothing."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    # As chat's image_url.detail: low caps a dynamic-resolution family's image; "original" is "high".
    detail: Literal["auto", "low", "high", "original"] | None = None


Part = Annotated[InputText | InputImage | OutputText, Field(discriminator="type")]


class InputMessage(_OutputItem):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[Part], Field(min_length=1)]


class FunctionCallItem(_OutputItem):
    """An earlier answer's function call sent back as input (serve/responses/tools.py renders it)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # JSON, as the answer gave it


class FunctionCallOutputItem(_OutputItem):
    """A function's result for the call ``call_id``: text, or a list of ``input_text`` parts."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[dict[str, Any]]


ITEM_TYPES = ("message", "function_call", "function_call_output")
InputItem = Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # check_body has refused every field not in the table

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = False
    previous_response_id: str | None = Field(default=None, min_length=1)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    tools: list[Any] | None = None  # function tools (serve/responses/tools.py)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None  # only "message.output_text.logprobs" (responses/fields.py)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    text: dict[str, Any] | None = None  # {"format": ...}: structured outputs (serve/structured.py)

    @model_validator(mode="before")
    @classmethod
    def _no_silent_ignore(cls, data):
        responses_fields.check_body(data)  # raises UnsupportedParameter (400), which pydantic passes on
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            items = []
            for i, item in enumerate(data["input"]):
                kind = item.get("type", "message") if isinstance(item, dict) else "message"
                if kind not in ITEM_TYPES:
                    raise UnsupportedParameter(f"input[{i}] is a {kind!r} item; fovea takes message, function_call "
                                               "and function_call_output items only (it has no built-in tools, "
                                               "reasoning items or item references).", param=f"input[{i}].type")
                items.append({**item, "type": kind} if isinstance(item, dict) else item)  # the union's tag
            data = {**data, "input": items}
        return data

    @model_validator(mode="after")
    def _top_logprobs_need_the_include(self):
        if self.top_logprobs and not self.wants_logprobs:
            # OpenAI returns log-probabilities only with the include: top_logprobs alone would be
            # a field quietly ignored.
            raise InvalidRequest(f"top_logprobs needs include: [\"{LOGPROBS_INCLUDE}\"] (as in OpenAI's API, the "
                                 "log-probabilities come only with it).", param="top_logprobs")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    @field_validator("input")
    @classmethod
    def _text_not_empty(cls, value):
        if isinstance(value, str) and not value:
            raise ValueError("the input is empty")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in value.items())):
            raise ValueError("at most 16 pairs, keys of at most 64 characters and values of at most 512")
        return value


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, status: str, text: str | None, logprobs: list[dict] | None = None) -> dict[str, Any]:
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def output_text(text: str, logprobs: list[dict] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def function_call_item(item_id: str, status: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def response_object(rid: str, req: ResponsesRequest, model: str, created: float, temperature: float, top_p: float,
                    status: str = "in_progress", output: list | None = None, usage: tuple[int, int] | None = None,
                    error: dict | None = None) -> dict[str, Any]:
    """The Response object, echoing the request's settings as OpenAI does."""
    done = status in ("completed", "incomplete")
    return {
        "id": rid, "object": "response", "created_at": int(created), "status": status,
        "completed_at": int(time.time()) if done else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output or [], "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "temperature": temperature, "top_p": top_p,
        "tool_choice": req.tool_choice or ("auto" if req.tools else "none"), "tools": req.tools or [],
        "top_logprobs": req.top_logprobs or 0,
        "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
        "truncation": "disabled", "background": False, "service_tier": "default", "store": req.store,
        "metadata": req.metadata or {}, "user": req.user, "safety_identifier": req.safety_identifier,
        "prompt_cache_key": req.prompt_cache_key, "reasoning": None,
        "usage": None if usage is None else {
            "input_tokens": usage[0], "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage[1], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage[0] + usage[1]},
    }


class EventWriter:
    """Server-sent events of the Responses API: ``event:`` names the type, and every event
    carries the stream's next ``sequence_number`` (from 0)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"
