"""serve/tools/stream.py on hand-written answers: every split of the text gives the same calls, the
streamed pieces join to the final parse's arguments, and a block that turns out to be no call
never leaves a wrong one behind."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fovea.serve.tools.calls import parse_block, parse_tool_calls
from fovea.serve.tools.stream import CallStream, ToolCallIncomplete

TRICKY = ('Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "ro}me", '
          '"note": "a \\"}\\" {x} </tool_call \\\\", "n": [1, {"b": 2}], "ok": true}}\n</tool_call>')
TWO = ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\nand then\n'
       '<tool_call>\n{"name": "g", "arguments": {"s": "x"}}\n</tool_call> done')
ANSWERS = [
    TRICKY,
    TWO,
    '<tool_call>{"arguments": {"x": [1, 2]}, "name": "late"}</tool_call>',  # the name after the arguments
    '<tool_call>  {  "name" :"f" ,"id": 7, "arguments":{ "a" : null } }  </tool_call>',  # whitespace, other keys
    '<tool_call>\n{"name": "s", "arguments": "{\\"a\\": 1}"}\n</tool_call>',  # arguments as a JSON string
    '<tool_call>\n{"name": "none"}\n</tool_call>',  # no arguments: {}
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}, "arguments": {"a": 2}}\n</tool_call>',  # a repeated key
]


def run(pieces: list[str], incremental: bool) -> tuple[list[tuple[str, str, bool]], list[tuple], CallStream]:
    """(each call's name, joined pieces, whether it ended; the events with pieces not joined)."""
    stream = CallStream(incremental)
    events = [e for piece in pieces for e in stream.feed(piece)]
    calls: dict[int, list] = {}
    for kind, i, value in events:
        if kind == "begin":
            assert i == len(calls)
            calls[i] = [value.name, "", False]
        elif kind == "arguments":
            assert not calls[i][2]
            calls[i][1] += value
        else:
            calls[i][2] = True
    return [tuple(c) for c in calls.values()], events, stream


def splits(text: str) -> list[list[str]]:
    return [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize("incremental", [True, False])
@pytest.mark.parametrize("text", ANSWERS)
def test_every_split_gives_the_final_calls(text, incremental):
    _, final = parse_tool_calls(text)
    expected = [(c["function"]["name"], c["function"]["arguments"], True) for c in final]
    repeated_key = text is ANSWERS[-1]
    for pieces in splits(text):
        calls, _, stream = run(pieces, incremental)
        if repeated_key and incremental and calls != expected:
            # {"a": 1} went out, then JSON's last key says {"a": 2}: the stream fails, never a wrong call.
            assert calls == [("f", '{"a": 1}', False)]
            with pytest.raises(ToolCallIncomplete):
                stream.finish()
            continue
        assert calls == expected, pieces
        _, finished, streamed = stream.finish()
        assert streamed == len(final) and [c["function"] for c in finished] == [c["function"] for c in final]
        assert [c["id"] for c in finished] == [c.id for c in stream.calls]


def test_the_final_arguments_are_the_models_own_text():
    _, (call,) = parse_tool_calls('<tool_call>{"name":"f","arguments":{"a":1,  "b":[2]}}</tool_call>')
    assert call["function"]["arguments"] == '{"a":1,  "b":[2]}'
    _, (call,) = parse_tool_calls(TRICKY)
    assert json.loads(call["function"]["arguments"]) == {"city": "ro}me", "note": 'a "}" {x} </tool_call \\',
                                                         "n": [1, {"b": 2}], "ok": True}
    assert parse_block('{"name": "s", "arguments": "{\\"a\\": 1}"}') == ("s", '{"a": 1}')
    assert parse_block('{"name": "f", "arguments": {"a": 1}, "arguments": {"a": 2}}') == ("f", '{"a": 2}')


def test_incremental_arguments_go_out_as_they_are_written():
    text = TRICKY
    _, events, _ = run(list(text), incremental=True)
    pieces = [value for kind, _, value in events if kind == "arguments"]
    assert len(pieces) > 20  # one piece per character, bar those held while they could begin </tool_call>
    # Before the block closes, the whole arguments object is out.
    cut = text.index("\n</tool_call>")
    calls, _, _ = run([text[:cut]], incremental=True)
    assert calls == [("get_weather", parse_tool_calls(text)[1][0]["function"]["arguments"], False)]
    # Without a grammar nothing goes out before the block has closed.
    assert run([text[:cut]], incremental=False)[0] == []


def test_name_waits_for_the_arguments_written_before_it():
    text = '<tool_call>{"arguments": {"x": [1, 2]}, "name": "late"}</tool_call>'
    before_name = text.index('"name"')
    assert run([text[:before_name]], incremental=True)[0] == []  # nothing without the name
    calls, events, _ = run([text[:-len("</tool_call>")]], incremental=True)
    assert events[0][0] == "begin" and calls == [("late", '{"x": [1, 2]}', False)]


@pytest.mark.parametrize("broken", ['<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call> ok',
                                    '<tool_call>\n{"name": "f", "arguments": {"a": 1}} x\n</tool_call>',
                                    '<tool_call>\n{"name": "f", "arguments": {"a": 1}'])  # cut by max_tokens
def test_a_block_that_is_no_call(broken):
    assert parse_tool_calls(broken) == (broken, [])  # it stays text
    calls, _, stream = run(list(broken), incremental=False)  # auto: nothing went out
    assert calls == [] and stream.finish() == (broken, [], 0)
    calls, _, stream = run(list(broken), incremental=True)  # a grammar's call cut or broken: loud
    assert calls and calls[0][0] == "f" and not calls[0][2]
    with pytest.raises(ToolCallIncomplete):
        stream.finish()


def test_text_after_an_open_tag_without_json_is_no_call():
    text = "<tool_call> nothing here </tool_call> and <tool_call"
    for incremental in (True, False):
        calls, _, stream = run(list(text), incremental)
        assert calls == [] and stream.finish() == (text, [], 0)


FRAGMENTS = ["<tool_call>", "</tool_call>", "\n", " ", '{"name": "f", ', '"name": "g"', '"arguments": ', "{", "}", '"a"',
             ": ", "1", ", ", '"x\\"}"', "[", "]", "tru", "hi", "</tool", "<tool_", '"\\\\"',
             '<tool_call>\n{"name": "f", "arguments": {"a": ', '}}\n</tool_call>', TWO]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=30), st.lists(st.integers(0, 400), max_size=8),
       st.booleans())
def test_never_a_wrong_call(fragments, cuts, incremental):
    """Whatever the text and wherever it is split: the streamed calls are the final parse's, or
    (only where pieces go out as written) the stream fails."""
    text = "".join(fragments)
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    calls, _, stream = run(pieces, incremental)
    try:
        _, finished, streamed = stream.finish()
    except ToolCallIncomplete:
        assert incremental
        return
    assert streamed == len(finished) and calls == [(c["function"]["name"], c["function"]["arguments"], True)
                                                   for c in finished]
