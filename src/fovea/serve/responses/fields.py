"""Every top-level field of the ``POST /v1/responses`` request body, in one table.

The same rules as ``serve/fields.py`` (and its ``Field`` class): each field is honoured,
accepted only where its value changes nothing, or refused with 400 ``unsupported_parameter``
naming it; a field not in the table is refused the same way. The fields are those of the
``openai`` package's ``ResponseCreateParams``. ``docs/api.md``'s table is built from this one
(``python -m fovea.serve.responses.fields`` prints it; a test checks the file matches).
"""

from __future__ import annotations

from typing import Any

from fovea.serve.fields import HONOURED, NOOP, REFUSED, Field, refuse_unknown_or_ignored

RESPONSES = "responses"
ONLY = frozenset({RESPONSES})


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _stream_options(v: Any) -> bool:
    return (isinstance(v, dict) and set(v) <= {"include_obfuscation", "include_usage"}
            and v.get("include_obfuscation", False) is False and isinstance(v.get("include_usage", False), bool))


def _field(name: str, status: str, note: str, **kw: Any) -> Field:
    return Field(name, status, note, ONLY, **kw)


LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TOOLS_DOC = "(docs/structured-outputs.md, \"Tools\")"
_STATE = "fovea keeps conversations only as stored responses: send `store: true` and `previous_response_id`"

FIELDS: tuple[Field, ...] = (
    # Honoured.
    _field("model", HONOURED, "must be the served model's name (GET /v1/models) or left out; another name is a "
           "404 `model_not_found`", example="fovea-shapes"),
    _field("input", HONOURED, "a string (one user message) or a list of messages whose content is a string or "
           "`input_text` / `input_image` parts (assistant messages: `output_text` parts); an `input_image` takes "
           "`image_url` (a data URL or an allowed URL, as chat's `image_url`) or `file_id` (an id from POST "
           "/v1/images); `function_call` and `function_call_output` items (an earlier call and its result) render as "
           "the chat template's assistant tool call and `tool` turn"),
    _field("instructions", HONOURED, "a system message placed first; not carried over by `previous_response_id`",
           example="Answer briefly."),
    _field("max_output_tokens", HONOURED, "the most tokens generated; reaching it makes the response "
           "`incomplete` with `incomplete_details.reason` `max_output_tokens`", example=2),
    _field("temperature", HONOURED, "0 to 2; 0 is greedy; the default is the model's generation_config",
           example=1.5),
    _field("top_p", HONOURED, "nucleus sampling, in (0, 1]", example=1e-6),
    _field("stream", HONOURED, "server-sent events of the Responses API (`response.created` ... "
           "`response.completed`, or `error` then `response.failed`)", example=True),
    _field("store", HONOURED, "`true` keeps the response in this server's memory for GET/DELETE "
           "/v1/responses/{id} and `previous_response_id`; the default is `false` (OpenAI's is `true`): fovea "
           "keeps nothing a client did not ask it to", example=True),
    _field("previous_response_id", HONOURED, "continue from a stored response: its input and output come before "
           "this `input` (its `instructions` do not); an id not stored here is a 404 `response_not_found`",
           example="resp_0"),
    _field("metadata", HONOURED, "up to 16 string pairs (keys up to 64 characters, values up to 512), echoed in "
           "the response and kept with a stored one", example={"k": "v"}),
    _field("text", HONOURED, "`{\"format\": {\"type\": \"json_schema\", \"name\", \"schema\", \"strict\"}}` or "
           "`{\"type\": \"json_object\"}`: structured outputs, as chat's `response_format` "
           "(docs/structured-outputs.md); `{\"type\": \"text\"}` is free text; `verbosity` is refused",
           values=lambda v: isinstance(v, dict) and v.get("verbosity") is not None,
           example={"format": {"type": "json_object"}}),
    _field("tools", HONOURED, "function tools, `{\"type\": \"function\", \"name\", \"description\", \"parameters\", "
           "\"strict\"}`, where the model's chat template renders tools (else 400 `tools_not_supported`); each call "
           "is a `function_call` output item " + _TOOLS_DOC + "; other tool types (`web_search`, `file_search`, "
           "`mcp`, ...) are refused by `tools[i].type`", example=[{"type": "function", "name": "f", "parameters": {}}]),
    _field("tool_choice", HONOURED, "`\"auto\"` (the default with tools), `\"none\"` (tools not rendered), "
           "`\"required\"` or `{\"type\": \"function\", \"name\"}`, both enforced by a grammar; other choices "
           "(`allowed_tools`, built-in tools, `mcp`) are refused", example="required"),
    _field("parallel_tool_calls", HONOURED, "with tools, `false` allows at most one call (the default `true`: "
           "one or more)", example=False),
    _field("include", HONOURED, f"`[\"{LOGPROBS_INCLUDE}\"]` adds the tokens' log-probabilities to the "
           "`output_text` part (`logprobs`) and to each `response.output_text.delta`; other values are refused",
           values=lambda v: not isinstance(v, list) or any(x != LOGPROBS_INCLUDE for x in v),
           example=[LOGPROBS_INCLUDE]),
    _field("top_logprobs", HONOURED, f"0 to 20 alternatives per token, with `include: [\"{LOGPROBS_INCLUDE}\"]` "
           "only (OpenAI returns log-probabilities only then; more than 0 without it is a 400 `invalid_request`)",
           example=2),
    # Accepted where they change nothing.
    _field("user", NOOP, "any string: an end-user id, echoed in the response; it does not change the answer",
           example="alice"),
    _field("safety_identifier", NOOP, "any string: an end-user id for abuse detection, which fovea does not do",
           example="alice"),
    _field("prompt_cache_key", NOOP, "any string: a routing hint for OpenAI's prompt cache; fovea's prefix "
           "caching needs none", example="k"),
    _field("stream_options", NOOP, "with `stream: true` only; `include_obfuscation` only `false` (fovea adds no "
           "obfuscation padding); `include_usage` (not OpenAI's, sent by vLLM-style clients such as aiperf) any "
           "boolean: the usage is always in `response.completed`; other keys are refused", values=_stream_options,
           example={"include_obfuscation": True}),
    _field("service_tier", NOOP, "only `\"auto\"` or `\"default\"`: fovea has one tier",
           values=lambda v: v in ("auto", "default"), example="flex"),
    _field("background", NOOP, "only `false`: fovea answers in the request", values=lambda v: v is False,
           example=True),
    _field("truncation", NOOP, "only `\"disabled\"`: an input too long for the context is a 400 "
           "`context_length_exceeded`, never cut", values=lambda v: v == "disabled", example="auto"),
    _field("reasoning", NOOP, "only `{}`: the served models do not reason", values=lambda v: v == {},
           example={"effort": "low"}),
    _field("max_tool_calls", NOOP, "any integer of 0 or more: it counts calls of built-in tools, which fovea has "
           "none of (function calls are not counted, as in OpenAI's API)",
           values=lambda v: _is_int(v) and v >= 0, example=-1),
    # Refused whatever the value (null aside).
    _field("conversation", REFUSED, "fovea has no conversation objects; " + _STATE, example="conv_1"),
    _field("context_management", REFUSED, "fovea does not compact context; leave it out",
           example=[{"type": "compaction"}]),
    _field("prompt", REFUSED, "fovea has no stored prompt templates; send the text as `input`",
           example={"id": "pmpt_1"}),
    _field("prompt_cache_options", REFUSED, "fovea has no prompt-cache breakpoints; leave it out",
           example={"mode": "explicit"}),
    _field("prompt_cache_retention", REFUSED, "fovea has no prompt-cache retention policies; leave it out",
           example="24h"),
    _field("background_options", REFUSED, "fovea has no background execution; leave it out",
           example={"completion_window": "2h"}),
    _field("moderation", REFUSED, "fovea runs no moderation; leave it out", example={"model": "m"}),
    _field("access_programs", REFUSED, "fovea has no access programs; leave it out", example={"cyber": "standard"}),
    _field("image", REFUSED, "fovea has no request-level image options (images are sent whole); leave it out",
           example={"context_compression": "enabled"}),
)

BY_NAME: dict[str, Field] = {f.name: f for f in FIELDS}


def check_body(body: Any) -> None:
    """Refuse what fovea would otherwise ignore: ``UnsupportedParameter`` (400) naming the field."""
    if not isinstance(body, dict):
        return  # the schema itself refuses a body that is not an object
    refuse_unknown_or_ignored(body, BY_NAME, "/v1/responses")


def markdown_table() -> str:
    rows = ["| field | status | notes |", "|---|---|---|"]
    rows += [f"| `{f.name}` | {f.status} | {f.note} |" for f in FIELDS]
    return "\n".join(rows)


if __name__ == "__main__":
    print(f"<!-- fields:{RESPONSES} -->\n{markdown_table()}\n<!-- /fields:{RESPONSES} -->")
