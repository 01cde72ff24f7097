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



FIELDS: tuple[Field, ...] = (
    # Honoured.
    Field("model", HONOURED, "must be the served model's name (GET /v1/models) or left out; another name is a "
          "404 `model_not_found`", example="fovea-shapes"),
    Field("messages", HONOURED, "the conversation, text, `image_url` and (video models) `video_url` parts",
          frozenset({CHAT})),
    Field("prompt", HONOURED, "raw prompts, used verbatim, in OpenAI's four shapes: a string (one image "
          "placeholder per entry of `images`), a list of token ids, or a batch: a list of strings or of lists of "
          "token ids (up to 128 prompts, without `images`), whose choices are indexed prompt by prompt, `n` each "
          "(choice `k * n + j` is prompt k's j-th), with every prompt counted in `usage`. A token id outside the "
          "vocabulary is a 400 naming it (`prompt[3]`, `prompt[1][3]`), as is the image token",
          frozenset({COMPLETIONS})),
    Field("images", HONOURED, "fovea extension: the image references for the prompt's placeholders",
          frozenset({COMPLETIONS})),
    Field("max_tokens", HONOURED, "the most tokens generated; unset: what the server's per-sequence limit "
          "(`max_model_len` in GET /v1/models) leaves after the prompt", example=2),
    Field("max_completion_tokens", HONOURED, "the same as `max_tokens` (wins when both are sent)", example=2),
    Field("temperature", HONOURED, "0 to 2; 0 is greedy; the default is the model's generation_config",
          example=1.5),
    Field("top_p", HONOURED, "nucleus sampling, in (0, 1]", example=1e-6),
    Field("seed", HONOURED, "seeds the sampler: the same seed gives the same answer", example=11),
    Field("stop", HONOURED, "up to 4 stop strings; the answer ends before the first one", example=[" and"]),
    Field("stream", HONOURED, "server-sent events ending with `data: [DONE]`", example=True),
    Field("stream_options", HONOURED, "`{\"include_usage\": true}` adds a usage chunk; with "
          "`\"continuous_usage_stats\": true` too, every chunk carries `usage` so far (vLLM; completion tokens "
          "summed over the choices); only with `stream: true` (as vLLM); other keys are refused",
          example={"include_usage": True}),
    Field("n", HONOURED, "1 to 128 choices, indexed 0..n-1 (streamed chunks name theirs); they share the prompt's KV "
          "blocks (the prefix cache); usage counts the prompt once and every choice's tokens; with `seed`, "
          "choice i is seeded `seed + i` (as vLLM), so choice 0 is the n=1 answer"),
    Field("logprobs", HONOURED, "chat: `true` adds `choices[].logprobs.content[]` (`token`, `logprob`, `bytes`, "
          "`top_logprobs`); completions: an integer 0..20 adds the legacy `tokens`, `token_logprobs`, `top_logprobs`, "
          "`text_offset`; streamed too. The model's raw log-probabilities, before bias, penalties and temperature "
          "(vLLM's default); an end-of-sequence or stop token that ends the answer has no entry"),
    Field("top_logprobs", HONOURED, "0 to 20 alternatives per token; needs `logprobs: true`", frozenset({CHAT})),
    Field("prompt_logprobs", HONOURED, "vLLM extension, an integer 0 to 20: the prompt's own log-probabilities, "
          "teacher-forced from its prefill, as vLLM lays them out: a list with one entry per prompt token (image "
          "placeholder tokens included), `null` for the first, then `{\"<token id>\": {\"logprob\", \"rank\", "
          "\"decoded_token\"}}` holding the prompt's own token (always, with its rank) and the `prompt_logprobs` "
          "most likely tokens; on the response (chat) or on each choice (completions, every choice of a prompt the "
          "same list: the prompt is scored once). Another value is a 400 `invalid_prompt_logprobs`; with "
          "`stream: true` a 400 `unsupported_parameter` (it is not streamed)", example=2),
    Field("presence_penalty", HONOURED, "-2 to 2, subtracted from the logit of every token already generated"),
    Field("frequency_penalty", HONOURED, "-2 to 2, times each token's count in the answer so far, subtracted from "
          "its logit"),
    Field("repetition_penalty", HONOURED, "vLLM extension, > 0: the logits of tokens in the prompt or the answer are "
          "divided by it when positive, multiplied when negative (transformers' rule); 1 is off"),
    Field("logit_bias", HONOURED, "token id -> -100..100 added to its logit; an id outside the vocabulary is a 400"),
    Field("stop_token_ids", HONOURED, "vLLM extension: generating one of these ids ends the answer (finish_reason "
          "`stop`); it counts in usage, not in the text, and cannot come before `min_tokens`"),
    Field("top_k", HONOURED, "vLLM extension: sample from the k most likely tokens; -1 or 0 is off"),
    Field("min_p", HONOURED, "vLLM extension, 0 to 1: drop tokens below min_p times the top token's probability"),
    Field("ignore_eos", HONOURED, "vLLM extension: end-of-sequence does not end the answer", example=True),
    Field("min_tokens", HONOURED, "vLLM extension: no end-of-sequence or stop string before this many tokens",
          example=6),
    Field("add_special_tokens", HONOURED, "vLLM extension: `true` has the tokenizer add its special tokens (a "
          "BOS) to the prompt, `false` adds none. Unset, completions get the tokenizer's default (a BOS where the "
          "tokenizer adds one) and chat the template's own (no second BOS after a template that writes one); "
          "`true` on chat adds them even then, as vLLM does. `/tokenize` reads it the same way", example=False),
    Field("fovea", HONOURED, "fovea extension: `{\"grounding\": true}` adds a per-request grounding score, "
          "`{\"timing\": true}` the request's encoder latency, time to first token and tokens/s",
          example={"grounding": True}),
    # Tools (docs/structured-outputs.md#tools): where the model's chat template renders them.
    Field("tools", HONOURED, "function tools, rendered by the model's chat template; the answer's "
          "`<tool_call>` blocks become `tool_calls`. A model whose template has no tools refuses them with 400 "
          "`tools_not_supported`", frozenset({CHAT}), example=[{"type": "function", "function": {"name": "f"}}]),
    Field("tool_choice", HONOURED, "`auto` (the model chooses), `required` or `{\"type\": \"function\", "
          "\"function\": {\"name\": ...}}` (enforced by a grammar), `none` (tools are not rendered)",
          frozenset({CHAT}), example="required"),
    Field("parallel_tool_calls", HONOURED, "false: at most one call (exactly one with `required`), by grammar; "
          "true (the default): any number", frozenset({CHAT}), example=False),
    Field("functions", HONOURED, "(deprecated) read as `tools`", frozenset({CHAT}), example=[{"name": "f"}]),
    Field("function_call", HONOURED, "(deprecated) read as `tool_choice`", frozenset({CHAT}), example="auto"),
    # Structured outputs (docs/structured-outputs.md): at most one of these per request.
    Field("response_format", HONOURED, "`{\"type\": \"json_object\"}` (any JSON) or `{\"type\": \"json_schema\", "
          "\"json_schema\": {\"name\", \"schema\", \"strict\"}}`: the answer matches, by grammar; `text`: free text",
          example={"type": "json_object"}),
    Field("structured_outputs", HONOURED, "vLLM extension (vLLM >= 0.12): one of `json` (a schema), `regex`, "
          "`choice`, `grammar` (EBNF) or `json_object: true`", example={"choice": ["yes", "no"]}),
    Field("guided_json", HONOURED, "older vLLM extension: `structured_outputs.json`", example={"type": "object"}),
    Field("guided_regex", HONOURED, "older vLLM extension: `structured_outputs.regex`", example="(yes|no)"),
    Field("guided_choice", HONOURED, "older vLLM extension: `structured_outputs.choice`", example=["yes", "no"]),
    Field("guided_grammar", HONOURED, "older vLLM extension: `structured_outputs.grammar` (EBNF, xgrammar's "
          "dialect)", example='root ::= "yes" | "no"'),
    # Accepted where they change nothing.
    Field("user", NOOP, "any string: an end-user id for the caller's records, which by definition does not "
          "change the answer; fovea does not store it", example="alice"),
    Field("metadata", NOOP, "any object of strings: tags for stored completions, which do not change the answer; fovea "
          "stores nothing", example={"k": "v"}),
    Field("store", NOOP, "only `false`: fovea stores no completions", values=_false, example=True),
    Field("service_tier", NOOP, "only `\"auto\"` or `\"default\"`: fovea has one tier",
          values=lambda v: v in ("auto", "default"), example="flex"),
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
    other = "/v1/completions" if endpoint == CHAT else "/v1/chat/completions"
    refuse_unknown_or_ignored(body, known, path, lambda name: f" (it belongs to {other})" if name in BY_NAME else "")


def refuse_unknown_or_ignored(body: dict[str, Any], known: dict[str, Field], path: str,
                              hint: Callable[[str], str] = lambda name: "") -> None:
    """Every endpoint's walk over a request body: a field ``path`` does not take, or a value its
    field would ignore, is ``UnsupportedParameter`` naming it (``hint`` adds where an unknown
    name belongs); ``stream_options`` needs ``stream: true``."""
    for name, value in body.items():
        field = known.get(name)
        if field is None:
            raise UnsupportedParameter(f"{name!r} is not a field fovea takes on {path}{hint(name)}; remove it "
                                       "(docs/api.md lists every field).", param=name)
        if field.refuses(value):
            raise UnsupportedParameter(f"{name}={value!r} is not supported: {field.note}.", param=name)
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise InvalidRequest("stream_options may only be sent with stream: true.", param="stream_options")


# /generate, fovea's simple shape, takes these and nothing else (stream, fovea, user, ... are refused).
GENERATE_FIELDS = ("model", "prompt", "image", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                   "seed", "stop", "n", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "logit_bias", "stop_token_ids", "top_k", "min_p")


def check_generate_body(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for name in body:
        if name not in GENERATE_FIELDS:
            raise UnsupportedParameter(f"/generate takes only {', '.join(GENERATE_FIELDS)}; {name!r} is not one of "
                                       "them: remove it, or use /v1/chat/completions (docs/api.md lists its fields).",
                                       param=name)


def markdown_table(endpoint: str) -> str:
    rows = ["| field | status | notes |", "|---|---|---|"]
    for f in fields_for(endpoint):
        rows.append(f"| `{f.name}` | {f.status} | {f.note} |")
    return "\n".join(rows)


if __name__ == "__main__":
    for ep in (CHAT, COMPLETIONS):
        print(f"<!-- fields:{ep} -->\n{markdown_table(ep)}\n<!-- /fields:{ep} -->\n")
