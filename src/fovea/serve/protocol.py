"""The OpenAI-compatible request schema (pydantic) and response builders."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from fovea.engine.core.request import PromptScoring
from fovea.engine.sampling.params import MAX_LOGPROBS
from fovea.errors import InvalidRequest
from fovea.serve import fields

MAX_N = 128  # OpenAI's limit on choices per request


class _Strict(BaseModel):
    # A key inside a message or a part that fovea does not take is a 400 unsupported_parameter
    # naming its path, as an unknown top-level field is: never ignored (docs/api.md, "Nested keys").
    model_config = ConfigDict(extra="forbid")


def null_only(value: Any) -> None:
    """A key OpenAI's SDK types that fovea has no use for: accepted as null, which changes nothing;
    any other value is refused (error type unsupported_parameter, at the key's path)."""
    if value is not None:
        raise PydanticCustomError("unsupported_parameter", "fovea takes this key only as null (it has no use for "
                                  "it); remove it")
    return None


NullOnly = Annotated[Any, BeforeValidator(null_only)]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str = Field(min_length=1)
    # Dynamic-resolution families cap a "low" image at LOW_DETAIL_PIXELS; fixed-resolution ones ignore it.
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(_Strict):
    url: str = Field(min_length=1)


class VideoURLPart(_Strict):
    """A video (models that take them: Qwen2.5-VL): a data:video/...;base64 URL or an allowed
    file:// / http(s):// URL, by the image sources' rules."""

    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1)
    arguments: str  # JSON, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(min_length=1)] | None = None
    name: str | None = None  # the participant's name, for chat templates that render it
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # OpenAI's SDK's assistant-message fields (an answer's .model_dump() sends them all, as null);
    # fovea's templates have no place for them.
    refusal: NullOnly = None
    audio: NullOnly = None
    function_call: NullOnly = None
    annotations: NullOnly = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # other keys are refused
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: with include_usage, every chunk carries the usage so far


class FoveaOptions(BaseModel):
    """fovea's extension field: ``"fovea": {...}`` in the request body."""

    model_config = ConfigDict(extra="forbid")
    grounding: bool = False
    timing: bool = False  # the response's fovea.timing: encoder latency, time to first token, tokens/s


class SamplingFields(BaseModel):
    # fields.check_body has refused every top-level field not in the table before this runs.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # torch.Generator's range
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)  # choices, sharing the prompt's KV blocks
    # vLLM's extensions, for fixed output lengths (benchmarks) and answers that must not end early.
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # vLLM's extensions.
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # Token id (a string of digits, as JSON keys are) -> bias added to its logit.
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    fovea: FoveaOptions | None = None
    # vLLM's extension: 0..MAX_LOGPROBS top tokens beside each prompt token's own log-probability.
    prompt_logprobs: Any = None
    # vLLM's extension: whether the tokenizer adds its special tokens (a BOS) to the prompt; None:
    # chat's template writes them (no second BOS), a raw prompt gets the tokenizer's default.
    add_special_tokens: bool | None = Field(default=None, strict=True)
    # Structured outputs (checked and compiled by serve/structured.py).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
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

    @field_validator("prompt_logprobs", mode="before")
    @classmethod
    def _prompt_logprobs(cls, value: Any) -> int | None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not 0 <= value <= MAX_LOGPROBS):
            raise InvalidRequest(f"prompt_logprobs is {value!r}; it must be an integer from 0 to {MAX_LOGPROBS}: how "
                                 "many of the most likely tokens to list beside each prompt token's own "
                                 "log-probability (0: the prompt token alone). Send one in that range, or leave it "
                                 "out.", code="invalid_prompt_logprobs", param="prompt_logprobs")
        return value

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self):
        if self.prompt_logprobs is not None and self.stream:
            raise fields.UnsupportedParameter(
                "prompt_logprobs is not streamed: the prompt's log-probabilities are read from its prefill and sent "
                "with the whole answer. Send the request with stream: false, or leave prompt_logprobs out.",
                param="prompt_logprobs")
        return self

    def prompt_scoring(self) -> PromptScoring | None:
        """What the request asks the engine to score of its prompt (None: nothing)."""
        return None if self.prompt_logprobs is None else PromptScoring(top=self.prompt_logprobs)

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids (integers as strings); {key!r} is not one")
        return value

    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def top_logprobs_wanted(self) -> int | None:
        """How many top tokens each generated token's log-probabilities carry; None: no logprobs."""
        return None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # Tools (checked by serve/tools/calls.py); functions/function_call are their deprecated shape.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true (as in the OpenAI API).", param="top_logprobs")
        return self

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="before")
    @classmethod
    def _no_silent_ignore(cls, data):
        fields.check_body(data, fields.CHAT)  # raises UnsupportedParameter (400), which pydantic passes on
        return data


MAX_PROMPTS = 128  # prompts in one completions request (a batch)
Prompt = str | list[int]  # text, or token ids


class CompletionRequest(SamplingFields):
    """Raw prompts, used verbatim: text (one ``<image>`` placeholder per entry of ``images``) or
    token ids, one prompt or a batch of them (OpenAI's four shapes)."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    images: list[str] = Field(default_factory=list, description="fovea extension: image references")
    # Strict: `true` (chat's spelling) is refused here rather than read as 1.
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS, strict=True)

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @model_validator(mode="before")
    @classmethod
    def _no_silent_ignore(cls, data):
        fields.check_body(data, fields.COMPLETIONS)
        return data

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value: str | list) -> str | list:
        batch = prompts_of(value)
        if not batch:
            raise ValueError("the prompt is empty")
        if len(batch) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request are supported; this one has {len(batch)}")
        for i, one in enumerate(batch):
            if not one:
                raise ValueError("the prompt is empty" if batch is not value else f"prompt[{i}] is empty")
        return value

    @property
    def prompts(self) -> list[Prompt]:
        """Every prompt of the request (one, or a batch's), each text or token ids."""
        return prompts_of(self.prompt)

    @property
    def is_batch(self) -> bool:
        """A list of prompts (strings, or lists of token ids), even of one."""
        return prompts_of(self.prompt) is self.prompt


def prompts_of(value: str | list) -> list[Prompt]:
    """The prompts in ``prompt``: a string or a list of ints is one; a list of either is a batch."""
    if isinstance(value, str) or (value and all(isinstance(v, int) for v in value)):
        return [value]
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


def chat_choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def text_choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_response(rid: str, model: str, choices: list[dict], usage: dict, extra: dict | None = None) -> dict:
    body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage}
    if extra:
        body["fovea"] = extra
    return body


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
               index: int = 0, logprobs: dict | None = None) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def text_response(rid: str, model: str, choices: list[dict], usage: dict, extra: dict | None = None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage}
    if extra:
        body["fovea"] = extra
    return body


def text_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None = None,
               index: int = 0, logprobs: dict | None = None) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
