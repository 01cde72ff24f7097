"""The OpenAI-compatible request schema (pydantic) and response builders."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fovea.serve import fields


class _Lenient(BaseModel):
    # OpenAI clients send fields fovea does not use (user, logprobs=false, ...): ignore them.
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImageURL(_Lenient):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Lenient):
    url: str = Field(min_length=1)


class VideoURLPart(_Lenient):
    """A video (models that take them: Qwen2.5-VL): a data:video/...;base64 URL or an allowed
    file:// / http(s):// URL, by the image sources' rules."""

    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[ContentPart], Field(min_length=1)] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # continuous_usage_stats and the like are refused
    include_usage: bool = False


class FoveaOptions(BaseModel):
    """fovea's extension field: ``"fovea": {...}`` in the request body."""

    model_config = ConfigDict(extra="forbid")
    grounding: bool = False
    timing: bool = False  # the response's fovea.timing: encoder latency, time to first token, tokens/s


class SamplingFields(_Lenient):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # torch.Generator's range
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Only n=1 (chat and completions refuse more as unsupported_parameter before this check).
    n: int = Field(default=1, ge=1, le=1, description="only n=1 is supported")
    # vLLM's extensions, for fixed output lengths (benchmarks) and answers that must not end early.
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    fovea: FoveaOptions | None = None
    # Accepted and unused: they describe the caller and cannot change the answer (docs/api.md).
    user: str | None = None
    metadata: dict[str, str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _no_silent_ignore(cls, data):
        fields.check_body(data, fields.CHAT)  # raises UnsupportedParameter (400), which pydantic passes on
        return data


class CompletionRequest(SamplingFields):
    """A raw prompt, used verbatim: one ``<image>`` placeholder per entry of ``images``."""

    prompt: str | list[str]
    images: list[str] = Field(default_factory=list, description="fovea extension: image references")

    @model_validator(mode="before")
    @classmethod
    def _no_silent_ignore(cls, data):
        fields.check_body(data, fields.COMPLETIONS)
        return data

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str:
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("exactly one prompt per request is supported")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


class GenerateRequest(SamplingFields):
    """The simple shape: a question and at most one image, rendered with the model's chat template."""

    prompt: str = Field(min_length=1)
    image: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_silent_ignore(cls, data):
        fields.check_generate_body(data)
        return data


def completion_id(prefix: str = "chatcmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def chat_response(rid: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int, extra: dict | None = None) -> dict:
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }],
        "usage": usage(prompt_tokens, completion_tokens),
    }
    if extra:
        body["fovea"] = extra
    return body


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }


def text_response(rid: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                  completion_tokens: int, extra: dict | None = None) -> dict:
    body = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }
    if extra:
        body["fovea"] = extra
    return body


def text_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None = None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
