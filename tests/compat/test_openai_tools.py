"""Tool calling through the official openai client: a tiny random Qwen2.5-VL whose template is
Qwen2.5's Hermes tool template (the grammar makes required and named calls valid whatever the
weights), and the demo model, whose template has no tools, for the refusal."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from structured_helpers import user

WEATHER = {"type": "object", "properties": {"city": {"enum": ["paris", "rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "flip", "parameters": {
             "type": "object", "properties": {"heads": {"type": "boolean"}}, "required": ["heads"],
             "additionalProperties": False}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(byte_server) -> openai.OpenAI:
    return byte_server.client()


def ask(client, **kw):
    kw.setdefault("messages", user("What is the weather in Rome?", image=True))
    return client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=kw.pop("max_tokens", 120),
                                          **kw)


def check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in PARAMS and (name is None or call.function.name == name)
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMS[call.function.name])
    return arguments


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_makes_one_valid_call(client, seed):
    reply = ask(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


def test_named_function_is_the_one_called(client):
    reply = ask(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        check_call(call, "get_weather")


def test_deprecated_functions_are_tools(client):
    reply = ask(client, functions=[t["function"] for t in TOOLS], function_call={"name": "flip"})
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["flip"]


STRICT = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]  # the client parses them


def test_streamed_arguments_rebuild_the_non_streamed_call(client):
    """Greedy: the same answer streamed and not. The client's stream manager accumulates the
    pieces; they join to exactly the non-streamed call's arguments."""
    kw = {"tools": STRICT, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
          "parallel_tool_calls": False, "temperature": 0.0, "seed": 0}
    whole = ask(client, **kw).choices[0]
    with client.chat.completions.stream(model=client.models.list().data[0].id, max_tokens=120,
                                        messages=user("What is the weather in Rome?", image=True), **kw) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert not [e for e in events if e.type == "content.delta" and e.delta]  # the call is not leaked as text
    pieces = [e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(pieces) > 1  # streamed as written, not whole at the end
    (call,) = final.message.tool_calls
    assert "".join(pieces) == call.function.arguments == whole.message.tool_calls[0].function.arguments
    assert call.function.name == whole.message.tool_calls[0].function.name == "get_weather"
    assert call.function.parsed_arguments == check_call(call, "get_weather")
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    first = next(c for c in _raw_chunks(client, kw) if c.choices and c.choices[0].delta.tool_calls)
    (delta,) = first.choices[0].delta.tool_calls  # OpenAI's shape: id, type and name first, arguments ""
    assert delta.id.startswith("call_") and delta.type == "function" and delta.function.arguments == ""


def _raw_chunks(client, kw) -> list:
    return list(ask(client, **kw, stream=True))


def test_a_call_cut_by_max_tokens_fails_the_stream(client):
    """The name went out, then max_tokens cut the arguments: an error, never a half call."""
    kw = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
          "max_tokens": 50}
    assert not ask(client, **kw).choices[0].message.tool_calls  # not streamed: the cut call stays text
    with pytest.raises(openai.APIError) as caught:
        for _ in ask(client, **kw, stream=True):
            pass
    assert caught.value.body["code"] == "tool_call_incomplete"


def test_tools_and_tool_turns_are_rendered(client):
    base = ask(client, max_tokens=1).usage.prompt_tokens
    with_tools = ask(client, tools=TOOLS, max_tokens=1).usage.prompt_tokens  # auto: the model chooses
    disabled = ask(client, tools=TOOLS, tool_choice="none", max_tokens=1).usage.prompt_tokens
    assert with_tools > base + 100 and disabled == base
    turns = user("Weather?") + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": '{"city": "rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 24 C"}]
    after = ask(client, messages=turns, tools=TOOLS, max_tokens=1).usage.prompt_tokens
    # The call and its result are rendered (this tokenizer: one token per byte).
    assert after >= with_tools + len('{"city": "rome", "days": 2}') + len("sunny, 24 C") - len("What is the weather in Rome?")


def test_refusals(client, live_server):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert caught.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert caught.value.body["code"] == "conflicting_structured_outputs"
    demo = live_server.client()
    for extra in ({"tools": TOOLS}, {"messages": [*user("hi"), {"role": "tool", "tool_call_id": "c", "content": "x"}]}):
        with pytest.raises(openai.BadRequestError) as caught:
            demo.chat.completions.create(model="fovea-shapes", **{"messages": user("hi"), **extra})
        assert caught.value.body["code"] == "tools_not_supported", caught.value.body


def test_auto_without_parallel_calls_makes_at_most_one(client):
    for seed in range(2):
        reply = ask(client, tools=TOOLS, parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=60)
        calls = reply.choices[0].message.tool_calls or []
        assert len(calls) <= 1
        for call in calls:
            check_call(call)


def test_streamed_calls_of_n_choices(client):
    stream = ask(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, stream=True, n=2,
                 temperature=1.0, seed=3)
    state = ChatCompletionStreamState()
    for chunk in stream:
        state.handle_chunk(chunk)
    choices = state.get_final_completion().choices
    assert [c.finish_reason for c in choices] == ["tool_calls", "tool_calls"]
    for choice in choices:
        assert len(choice.message.tool_calls) == 1 and not choice.message.content
        check_call(choice.message.tool_calls[0])
