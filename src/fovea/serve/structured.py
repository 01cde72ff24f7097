"""A request's structured-output fields -> one grammar for the engine (docs/structured-outputs.md).

Sources, at most one per request:
- OpenAI's ``response_format``: ``{"type": "json_object"}`` or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema), ``regex``, ``choice``,
  ``grammar`` (EBNF) or ``json_object: true`` (what vLLM takes since 0.12);
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``
  (removed in vLLM 0.12, still sent by older clients).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fovea.engine.structured.spec import GrammarSpec
from fovea.errors import FoveaError, InvalidRequest

log = logging.getLogger("fovea.serve")

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StructuredOutputsUnavailable(FoveaError):
    status, code = 400, "structured_outputs_unavailable"


def _schema(value: Any, param: str) -> GrammarSpec:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{param} is not valid JSON: {exc}", code="invalid_json_schema", param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param} must be a JSON schema object.", code="invalid_json_schema", param=param)
    return GrammarSpec.json_schema(value, param)


def _one(kind: str, value: Any, param: str) -> GrammarSpec:
    if kind == "json":
        return _schema(value, param)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequest(f"{param} must be true.", param=param)
        return GrammarSpec("json_object", "", param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise InvalidRequest(f"{param} must be a non-empty list of non-empty strings.", code="invalid_choice",
                                 param=param)
        return GrammarSpec.choice(value, param)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param} must be a non-empty string.", param=param)
    return GrammarSpec(kind, value, param)


def _response_format(value: Any) -> GrammarSpec | None:
    if not isinstance(value, dict):
        raise InvalidRequest("response_format must be an object.", param="response_format")
    kind = value.get("type")
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return GrammarSpec("json_object", "", "response_format")
    if kind == "json_schema":
        body = value.get("json_schema")
        extra = set(value) - {"type", "json_schema"}
        if extra or not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise InvalidRequest("response_format of type json_schema takes {\"type\": \"json_schema\", \"json_schema\": "
                                 "{\"name\": ..., \"schema\": {...}, \"strict\": ...}}.", param="response_format")
        unknown = set(body) - {"name", "schema", "strict", "description"}
        if unknown:
            raise InvalidRequest(f"response_format.json_schema takes name, schema, strict and description, not "
                                 f"{sorted(unknown)}.", param="response_format.json_schema")
        # strict or not, the grammar enforces the schema: strict=false is not weaker here (OpenAI's
        # non-strict mode is best effort; this is the exact schema).
        return _schema(body.get("schema", {}), "response_format.json_schema.schema")
    raise InvalidRequest("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         "{\"type\": \"json_schema\", \"json_schema\": {...}}.", param="response_format")


def requested_grammar(req: Any) -> GrammarSpec | None:
    """The request's grammar, or None for free text; refuses two sources at once and bad shapes."""
    specs: list[GrammarSpec] = []
    if getattr(req, "response_format", None) is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            specs.append(spec)
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequest("structured_outputs must be an object.", param="structured_outputs")
        unknown = set(so) - set(STRUCTURED_KEYS)
        if unknown:
            raise InvalidRequest(f"structured_outputs takes one of {', '.join(STRUCTURED_KEYS)}; {sorted(unknown)} "
                                 "are not supported.", code="unsupported_parameter", param="structured_outputs")
        given = [(k, v) for k, v in so.items() if v is not None and v is not False]
        specs.extend(_one(k, v, f"structured_outputs.{k}") for k, v in given)
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            specs.append(_one(kind, value, name))
    if len(specs) > 1:
        raise InvalidRequest(f"the request asks for {len(specs)} output formats at once ({', '.join(s.param for s in specs)}); "
                             "send one.", code="conflicting_structured_outputs", param=specs[1].param)
    if not specs:
        return None
    spec = specs[0]
    if req.ignore_eos:
        raise InvalidRequest("ignore_eos cannot be combined with a structured output: the answer ends when its "
                             "grammar is complete.", code="conflicting_structured_outputs", param="ignore_eos")
    if req.min_tokens:
        raise InvalidRequest("min_tokens cannot be combined with a structured output: a complete answer may be "
                             "shorter.", code="conflicting_structured_outputs", param="min_tokens")
    return spec


def text_format_grammar(text: Any) -> GrammarSpec | None:
    """The Responses API's ``text``: ``{"format": {"type": "text"}}`` (None: free text),
    ``{"type": "json_object"}``, or ``{"type": "json_schema", "name", "schema", "strict",
    "description"}`` (flat, unlike chat's ``response_format``)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise InvalidRequest("text must be an object: {\"format\": {...}}.", param="text")
    if text.get("verbosity") is not None:
        raise InvalidRequest("text.verbosity is not supported: the served models have no verbosity setting; leave "
                             "it out.", code="unsupported_parameter", param="text.verbosity")
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise InvalidRequest(f"text takes format (and verbosity), not {sorted(unknown)}.",
                             code="unsupported_parameter", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return GrammarSpec("json_object", "", "text.format")
    if kind == "json_schema":
        unknown = set(fmt) - {"type", "name", "schema", "strict", "description"}
        if unknown or "schema" not in fmt or not isinstance(fmt.get("name"), str):
            raise InvalidRequest("text.format of type json_schema takes {\"type\": \"json_schema\", \"name\": ..., "
                                 "\"schema\": {...}, \"strict\": ..., \"description\": ...}"
                                 + (f", not {sorted(unknown)}" if unknown else "") + ".", param="text.format")
        return _schema(fmt["schema"], "text.format.schema")
    raise InvalidRequest("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                         "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}.", param="text.format")


async def compile_request_grammar(state: Any, req: Any, added: GrammarSpec | None = None) -> Any:
    """The compiled grammar for ``req`` (None: free text), compiled off the event loop and cached;
    ``added``: the endpoint's own (tool calls), which excludes the request's."""
    spec = requested_grammar(req)
    if added is not None:
        refuse_with_tools(spec)
        spec = added
    return await compile_spec(state, spec)


def refuse_with_tools(spec: GrammarSpec | None) -> None:
    """Tool calls have their own grammar (or none, for ``auto``): a request's output format
    cannot be enforced beside it."""
    if spec is not None:
        raise InvalidRequest(f"{spec.param} cannot be combined with tools: send one or the other.",
                             code="conflicting_structured_outputs", param=spec.param)


async def compile_spec(state: Any, spec: GrammarSpec | None) -> Any:
    """``spec`` compiled (cached, off the event loop); None stays None (free text)."""
    if spec is None:
        return None
    if state.grammars is None:
        raise StructuredOutputsUnavailable("structured outputs need the xgrammar package, which this server "
                                           "cannot import; install it (pip install xgrammar).", param=spec.param)
    return await state.grammars.get(spec)


def build_grammar_compiler(loaded: Any, vocab_size: int) -> Any:
    """The model's grammar compiler, or None (logged) when xgrammar is not installed or cannot
    read the tokenizer: structured requests are then refused (structured_outputs_unavailable)."""
    try:
        from fovea.engine.structured.compiler import GrammarCompiler
    except ImportError as exc:
        log.warning("structured outputs are off: xgrammar cannot be imported (%s)", exc)
        return None
    eos = sorted(t for t in loaded.eos_token_ids if isinstance(t, int) and t >= 0)
    try:
        return GrammarCompiler(loaded.tokenizer, vocab_size, eos)
    except Exception as exc:  # noqa: BLE001 - a tokenizer xgrammar cannot read must not stop the server
        log.warning("structured outputs are off: xgrammar cannot use this model's tokenizer (%s: %s)",
                    type(exc).__name__, exc)
        return None
