"""Every top-level field of the chat-completions and completions request bodies, in one table.

Each field is honoured, accepted only where its value changes nothing (a no-op), or refused
with 400 ``unsupported_parameter`` naming it. A field in neither schema is refused the same
way: fovea never ignores a field silently. ``docs/api.md`` is built from this table
(``python -m fovea.serve.fields`` prints the tables; a test checks the file matches).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fovea.errors import FoveaError, InvalidRequest

CHAT, COMPLETIONS = "chat", "completions"
BOTH = frozenset({CHAT, COMPLETIONS})
HONOURED, NOOP, REFUSED = "honoured", "no-op", "refused"


class UnsupportedParameter(FoveaError):
    status, code = 400, "unsupported_parameter"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _zero(v: Any) -> bool:
    return _is_num(v) and v == 0


def _empty(v: Any) -> bool:
    return isinstance(v, (list, dict)) and not v


def _false(v: Any) -> bool:
    return v is False


@dataclass(frozen=True)
class Field:
    name: str
    status: str  # HONOURED | NOOP | REFUSED
    note: str  # honoured: what it does; no-op: which values pass and why; refused: what to do instead
    endpoints: frozenset[str] = BOTH
    # For NOOP fields: the values accepted (None is always accepted: it is the default).
    # For HONOURED fields: the values that ask for something fovea does not do (refused).
    values: Callable[[Any], bool] | None = None
    example: Any = None  # a value the schema test sends: honoured, or refused for NOOP/REFUSED fields

    def refuses(self, value: Any) -> bool:
        if value is None:
            return False
        if self.status == REFUSED:
            return True
        if self.status == NOOP:
            return not (self.values is None or self.values(value))
        return self.values is not None and self.values(value)


_LOGPROBS = "fovea returns no log-probabilities; leave it out"
_TOOLS = "fovea has no tool calling; leave it out (or send an empty list) and describe tools in the prompt"

FIELDS: tuple[Field, ...] = (
    # Honoured.
    Field("model", HONOURED, "must be the served model's name (GET /v1/models) or left out; another name is a "
          "404 `model_not_found`", example="fovea-shapes"),
    Field("messages", HONOURED, "the conversation, text, `image_url` and (video models) `video_url` parts",
          frozenset({CHAT})),
    Field("prompt", HONOURED, "one raw prompt (a string, or a list of exactly one), used verbatim: one image "
          "placeholder per entry of `images`", frozenset({COMPLETIONS})),
    Field("images", HONOURED, "fovea extension: the image references for the prompt's placeholders",
          frozenset({COMPLETIONS})),
    Field("max_tokens", HONOURED, "the most tokens generated", example=2),
    Field("max_completion_tokens", HONOURED, "the same as `max_tokens` (wins when both are sent)", example=2),
    Field("temperature", HONOURED, "0 to 2; 0 is greedy; the default is the model's generation_config",
          example=1.5),
    Field("top_p", HONOURED, "nucleus sampling, in (0, 1]", example=1e-6),
    Field("seed", HONOURED, "seeds the sampler: the same seed gives the same answer", example=11),
    Field("stop", HONOURED, "up to 4 stop strings; the answer ends before the first one", example=[" and"]),
    Field("stream", HONOURED, "server-sent events ending with `data: [DONE]`", example=True),
    Field("stream_options", HONOURED, "`{\"include_usage\": true}` adds a usage chunk; only with `stream: true` "
          "(as vLLM); other keys are refused", example={"include_usage": True}),
    Field("n", HONOURED, "only 1: more than one choice per request is refused",
          values=lambda v: _is_int(v) and v > 1, example=2),
    Field("ignore_eos", HONOURED, "vLLM extension: end-of-sequence does not end the answer", example=True),
    Field("min_tokens", HONOURED, "vLLM extension: no end-of-sequence or stop string before this many tokens",
          example=6),
    Field("fovea", HONOURED, "fovea extension: `{\"grounding\": true}` adds a per-request grounding score, "
          "`{\"timing\": true}` the request's encoder latency, time to first token and tokens/s",
          example={"grounding": True}),
    # Accepted where they change nothing.
    Field("user", NOOP, "any string: an end-user id for the caller's records, which by definition does not "
          "change the answer; fovea does not store it", example="alice"),
    Field("metadata", NOOP, "any object of strings: tags for stored completions, which do not change the answer; fovea "
          "stores nothing", example={"k": "v"}),
    Field("store", NOOP, "only `false`: fovea stores no completions", values=_false, example=True),
    Field("service_tier", NOOP, "only `\"auto\"` or `\"default\"`: fovea has one tier",
          values=lambda v: v in ("auto", "default"), example="flex"),
    Field("parallel_tool_calls", NOOP, "any boolean: it only matters with tools, and tools are refused",
          frozenset({CHAT}), values=lambda v: isinstance(v, bool), example="yes"),
    Field("logprobs", NOOP, "chat: only `false`; completions: only null. " + _LOGPROBS,
          values=_false, example=True),
    Field("top_logprobs", NOOP, "only 0. " + _LOGPROBS, frozenset({CHAT}), values=_zero, example=2),
    Field("presence_penalty", NOOP, "only 0: fovea applies no penalties", values=_zero, example=0.5),
    Field("frequency_penalty", NOOP, "only 0: fovea applies no penalties", values=_zero, example=0.5),
    Field("repetition_penalty", NOOP, "vLLM extension; only 1: fovea applies no penalties",
          values=lambda v: _is_num(v) and v == 1, example=1.2),
    Field("top_k", NOOP, "vLLM extension; only -1 or 0 (off): fovea has no top-k; use `top_p`",
          values=lambda v: _is_int(v) and v in (-1, 0), example=5),
    Field("min_p", NOOP, "vLLM extension; only 0 (off): fovea has no min-p; use `top_p`", values=_zero,
          example=0.1),
    Field("logit_bias", NOOP, "only `{}`: fovea applies no logit bias", values=_empty, example={"1": 5}),
    Field("stop_token_ids", NOOP, "vLLM extension; only `[]`: use `stop` strings", values=_empty, example=[2]),
    Field("response_format", NOOP, "only `{\"type\": \"text\"}`: fovea has no JSON mode or structured outputs",
          frozenset({CHAT}), values=lambda v: v == {"type": "text"}, example={"type": "json_object"}),
    Field("tools", NOOP, "only `[]`. " + _TOOLS, values=_empty, endpoints=frozenset({CHAT}),
          example=[{"type": "function", "function": {"name": "f"}}]),
    Field("tool_choice", NOOP, "only `\"none\"`. " + _TOOLS, values=lambda v: v == "none",
          endpoints=frozenset({CHAT}), example="auto"),
    Field("functions", NOOP, "(deprecated) only `[]`. " + _TOOLS, values=_empty, endpoints=frozenset({CHAT}),
          example=[{"name": "f"}]),
    Field("function_call", NOOP, "(deprecated) only `\"none\"`. " + _TOOLS, values=lambda v: v == "none",
          endpoints=frozenset({CHAT}), example="auto"),
    Field("modalities", NOOP, "only `[\"text\"]`: fovea answers in text", values=lambda v: v == ["text"],
          endpoints=frozenset({CHAT}), example=["text", "audio"]),
    Field("echo", NOOP, "only `false`: send the prompt back yourself if you need it", values=_false,
          endpoints=frozenset({COMPLETIONS}), example=True),
    Field("best_of", NOOP, "only 1: fovea generates one candidate", values=lambda v: _is_int(v) and v == 1,
          endpoints=frozenset({COMPLETIONS}), example=3),
    Field("suffix", NOOP, "only `\"\"`: fovea does not insert text", values=lambda v: v == "",
          endpoints=frozenset({COMPLETIONS}), example="!"),
    # Refused whatever the value (null aside).
    Field("audio", REFUSED, "fovea has no audio output; leave it out", frozenset({CHAT}),
          example={"voice": "alloy", "format": "wav"}),
    Field("prediction", REFUSED, "fovea has no predicted outputs; leave it out", frozenset({CHAT}),
          example={"type": "content", "content": "x"}),
    Field("reasoning_effort", REFUSED, "the served models do not reason; leave it out", frozenset({CHAT}),
          example="low"),
    Field("web_search_options", REFUSED, "fovea has no web search; leave it out", frozenset({CHAT}),
          example={}),
)

BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}


def fields_for(endpoint: str) -> list[Field]:
    return [f for f in FIELDS if endpoint in f.endpoints]


def check_body(body: Any, endpoint: str) -> None:
    """Refuse what fovea would otherwise ignore: raises ``UnsupportedParameter`` (400) naming the field."""
    if not isinstance(body, dict):
        return  # the schema itself refuses a body that is not an object
    known = {f.name: f for f in fields_for(endpoint)}
    path = "/v1/chat/completions" if endpoint == CHAT else "/v1/completions"
    for name, value in body.items():
        field = known.get(name)
        if field is None:
            other = BY_NAME.get(name)
            where = (f" (it belongs to {'/v1/completions' if endpoint == CHAT else '/v1/chat/completions'})"
                     if other is not None else "")
            raise UnsupportedParameter(f"{name!r} is not a field fovea takes on {path}{where}; remove it "
                                       "(docs/api.md lists every field).", param=name)
        if field.refuses(value):
            raise UnsupportedParameter(f"{name}={value!r} is not supported: {field.note}.", param=name)
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise InvalidRequest("stream_options may only be sent with stream: true.", param="stream_options")


# /generate, fovea's simple shape, takes these and nothing else (stream, fovea, user, ... are refused).
GENERATE_FIELDS = ("model", "prompt", "image", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                   "seed", "stop", "n", "ignore_eos", "min_tokens")


def check_generate_body(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for name in body:
        if name not in GENERATE_FIELDS:
            raise UnsupportedParameter(f"/generate takes only {', '.join(GENERATE_FIELDS)}; {name!r} is not one of "
                                       "them: remove it, or use /v1/chat/completions (docs/api.md lists its fields).",
                                       param=name)
    n = body.get("n")
    if _is_int(n) and n > 1:
        raise UnsupportedParameter(f"n={n} is not supported: only 1.", param="n")


def markdown_table(endpoint: str) -> str:
    rows = ["| field | status | notes |", "|---|---|---|"]
    for f in fields_for(endpoint):
        rows.append(f"| `{f.name}` | {f.status} | {f.note} |")
    return "\n".join(rows)


if __name__ == "__main__":
    for ep in (CHAT, COMPLETIONS):
        print(f"<!-- fields:{ep} -->\n{markdown_table(ep)}\n<!-- /fields:{ep} -->\n")
