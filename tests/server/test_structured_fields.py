"""serve/structured.py without a server: which grammar a request asks for, and its refusals."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from fovea.errors import InvalidRequest
from fovea.serve.protocol import CompletionRequest
from fovea.serve.structured import StructuredOutputsUnavailable, compile_request_grammar, requested_grammar


def req(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="x", **fields)


def test_each_source_gives_one_spec():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = requested_grammar(req(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}))
    assert spec.kind == "json_schema" and list(json.loads(spec.source)["properties"]) == ["b", "a"]  # order kept
    assert requested_grammar(req(guided_json=json.dumps(schema))).key == spec.key  # the same cache entry
    assert requested_grammar(req(response_format={"type": "text"})) is None
    assert requested_grammar(req(structured_outputs={"json_object": True})).kind == "json_object"
    assert requested_grammar(req(structured_outputs={"choice": ["a", "b"]})).kind == "choice"
    assert requested_grammar(req(guided_regex="a+")).param == "guided_regex"
    assert requested_grammar(req()) is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens"),
])
def test_refusals(fields, param):
    with pytest.raises(InvalidRequest) as caught:
        requested_grammar(req(**fields))
    assert caught.value.param == param


def test_without_xgrammar_a_structured_request_is_refused():
    with pytest.raises(StructuredOutputsUnavailable):
        asyncio.run(compile_request_grammar(SimpleNamespace(grammars=None), req(guided_regex="a")))
    assert asyncio.run(compile_request_grammar(SimpleNamespace(grammars=None), req())) is None  # free text: fine
