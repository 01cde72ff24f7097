"""The request schema of POST /v1/responses and the shapes of its answers (objects and stream events)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fovea.serve import responses_fields
from fovea.serve.fields import UnsupportedParameter


class _Lenient(BaseModel):
    # Keys inside items and parts that fovea does not use (an item's id or status) are ignored,
    # as chat ignores them inside messages (docs/api.md, "Scope").
    model_config = ConfigDict(extra="ignore")


class InputText(_Lenient):
    type: Literal["input_text"]
    text: str


class OutputText(_Lenient):
    """An earlier answer sent back as input (an assistant message's content)."""

    type: Literal["output_text"]
    text: str


class InputImage(_Lenient):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None  # fovea sends every image whole


Part = Annotated[InputText | InputImage | OutputText, Field(discriminator="type")]


class InputMessage(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[Part], Field(min_length=1)]


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # check_body has refused every field not in the table

    model: str | None = None
    input: str | Annotated[list[InputMessage], Field(min_length=1)]
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
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": ...}: structured outputs (serve/structured.py)

    @model_validator(mode="before")
    @classmethod
    def _no_silent_ignore(cls, data):
        responses_fields.check_body(data)  # raises UnsupportedParameter (400), which pydantic passes on
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            for i, item in enumerate(data["input"]):
                kind = item.get("type", "message") if isinstance(item, dict) else "message"
                if kind != "message":
                    raise UnsupportedParameter(f"input[{i}] is a {kind!r} item; fovea takes message items only "
                                               "(it has no tools, reasoning items or item references).",
                                               param=f"input[{i}].type")
        return data

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


def message_item(item_id: str, status: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


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
        "output": output or [], "parallel_tool_calls": bool(req.parallel_tool_calls),
        "previous_response_id": req.previous_response_id, "temperature": temperature, "top_p": top_p,
        "tool_choice": req.tool_choice or "none", "tools": [],
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
