"""serve/tools/calls.py without a server: parsing calls, holding streamed text back, template checks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from fovea.engine.core.request import FinishEvent
from fovea.serve.tools.calls import ToolsNotSupported, check_template, parse_tool_calls
from fovea.serve.tools.chunks import ToolFormat
from fovea.serve.tools.stream import ToolCallIncomplete
from fovea.testing import random_qwen2_5_vl
from fovea.testing.byte_level_model import TOOLS_TEMPLATE


def test_parse_calls_and_text():
    text = 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n' \
           '{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"a": 1}),
                                                                                                  ("g", {})]
    assert parse_tool_calls("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    assert parse_tool_calls("plain") == ("plain", [])


def test_stream_holds_back_a_possible_call():
    fmt = ToolFormat()  # no grammar: the call goes out whole once its block has closed and parsed
    pieces = ["Hi <", "tool", "_call>\n{\"name\": \"f\", ", "\"arguments\": {}}\n</tool_call>"]
    chunks = [c["choices"][0]["delta"] for p in pieces for c in fmt.on_text("r", "m", 0, p)]
    assert [d["content"] for d in chunks if "content" in d] == ["Hi "]  # "<" waited: it could begin a call, and did
    calls = [d["tool_calls"][0] for d in chunks if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "f", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert [c["function"]["arguments"] for c in calls[1:]] == ["{}"] and {c["index"] for c in calls} == {0}
    (last,) = fmt.on_finish("r", "m", 0, "stop")
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    plain = ToolFormat()
    assert [c["choices"][0]["delta"]["content"] for c in plain.on_text("r", "m", 0, "a <to")] == ["a "]
    *rest, end = plain.on_finish("r", "m", 0, "length")
    assert rest[0]["choices"][0]["delta"]["content"] == "<to" and end["choices"][0]["finish_reason"] == "length"


def test_response_has_tool_calls():
    finish = FinishEvent("stop", '<tool_call>\n{"name": "f", "arguments": {"x": [1]}}\n</tool_call>', 3, 9, None, 0.1)
    choice = ToolFormat().choice(0, finish, None)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"x": [1]}


@pytest.mark.parametrize(("template", "ok"), [(TOOLS_TEMPLATE, True), (random_qwen2_5_vl.CHAT_TEMPLATE, False)])
def test_template_check(template, ok):
    """Qwen2.5-VL's own template renders no tools: refused."""
    loaded = SimpleNamespace(processor=SimpleNamespace(chat_template=None), tokenizer=SimpleNamespace(
        chat_template=template))
    if ok:
        check_template(loaded, "tools", "tools")
    else:
        with pytest.raises(ToolsNotSupported):
            check_template(loaded, "tools", "tools")


def test_stream_sends_arguments_as_written_where_a_grammar_enforces_the_call():
    fmt = ToolFormat(incremental=True)
    pieces = ['<tool_call>\n{"name": "f", "arg', 'uments": {"a": ', '"x}"', ', "b": 2', '}}\n</tool_call>']
    deltas = [c["choices"][0]["delta"]["tool_calls"][0] for p in pieces for c in fmt.on_text("r", "m", 0, p)]
    assert deltas[0]["function"] == {"name": "f", "arguments": ""} and deltas[0]["type"] == "function"
    assert [d["function"]["arguments"] for d in deltas[1:]] == ['{"a": ', '"x}"', ', "b": 2', "}"]
    assert all(set(d) == {"index", "function"} and d["index"] == 0 for d in deltas[1:])
    (last,) = fmt.on_finish("r", "m", 0, "stop")
    assert last["choices"][0]["finish_reason"] == "tool_calls"
    cut = ToolFormat(incremental=True)
    cut.on_text("r", "m", 0, pieces[0] + pieces[1])
    with pytest.raises(ToolCallIncomplete):  # max_tokens cut the call: no finish chunk, an error
        cut.on_finish("r", "m", 0, "length")


def test_strict_tools_hold_every_auto_call_to_its_schema():
    """With ``auto`` and parallel calls nothing is constrained, unless a tool asks for ``strict``:
    then text runs free, any number of calls may come, and each one that begins is valid."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from fovea.errors import InvalidRequest
    from fovea.serve.tools.calls import ToolRequest, call_grammar, function_spec

    days = {"type": "object", "properties": {"days": {"type": "integer"}}, "required": ["days"],
            "additionalProperties": False}

    def tools(**extra):
        return [{"type": "function", "function": function_spec({"name": "f", "parameters": days, **extra}, "t")}]

    assert call_grammar(ToolRequest(tools(), "auto", None, True)) is None
    assert call_grammar(ToolRequest(tools(strict=False), "auto", None, True)) is None
    grammar = xgr.Grammar.from_structural_tag(call_grammar(ToolRequest(tools(strict=True), "auto", None, True)).source)
    call = '<tool_call>\n{"name": "f", "arguments": %s}\n</tool_call>'
    assert accepts(grammar, "no call at all")
    assert accepts(grammar, "two: " + call % '{"days": 2}' + " and " + call % '{"days": 3}')
    assert not accepts(grammar, "one: " + call % '{"weeks": 2}')
    with pytest.raises(InvalidRequest, match="strict must be true or false"):
        tools(strict="yes")
