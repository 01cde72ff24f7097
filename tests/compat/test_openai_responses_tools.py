"""Function tools and log-probabilities on /v1/responses through the official openai client, on the
tiny random Qwen2.5-VL with Qwen2.5's Hermes tool template (random weights: the grammar makes
required and named calls valid whatever they are) and, for the refusal, the demo model."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_openai_tools import PARAMS, TOOLS

from fovea.testing.tolerance import api_logprobs_atol

FLAT = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's shape: not nested
LOGPROBS = "message.output_text.logprobs"
QUESTION = "What is the weather in Rome?"


@pytest.fixture(scope="module")
def client(byte_server) -> openai.OpenAI:
    return byte_server.client()


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def create(client, model, **kw):
    kw.setdefault("input", QUESTION)
    kw.setdefault("max_output_tokens", 120)
    return client.responses.create(model=model, **kw)


def check_call(item, name: str | None = None) -> dict:
    assert item.type == "function_call" and item.id.startswith("fc_") and item.call_id.startswith("call_")
    assert item.status == "completed" and item.name in PARAMS and (name is None or item.name == name)
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, PARAMS[item.name])
    return arguments


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_makes_one_valid_function_call_item(client, model, temperature):
    reply = create(client, model, tools=FLAT, tool_choice="required", parallel_tool_calls=False,
                   temperature=temperature)
    assert reply.status == "completed" and [i.type for i in reply.output] == ["function_call"]
    check_call(reply.output[0])
    assert reply.output_text == ""  # the client's convenience: the text items only, and there are none
    assert reply.tool_choice == "required" and [t.name for t in reply.tools] == list(PARAMS)


def test_named_function_is_the_one_called(client, model):
    reply = create(client, model, tools=FLAT, tool_choice={"type": "function", "name": "flip"})
    assert reply.output and all(check_call(item, "flip") is not None for item in reply.output)


def test_a_call_and_its_output_continue_the_conversation(client, model):
    first = create(client, model, tools=FLAT, tool_choice={"type": "function", "name": "get_weather"},
                   parallel_tool_calls=False, store=True)
    (call,) = first.output
    arguments = check_call(call, "get_weather")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}
    direct = create(client, model, tools=FLAT, max_output_tokens=1,
                    input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result])
    # The same conversation through chat: an assistant tool-call turn and a tool turn.
    chat = client.chat.completions.create(model=model, tools=TOOLS, max_tokens=1, messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 24 C"}])
    assert direct.usage.input_tokens == chat.usage.prompt_tokens
    assert direct.usage.input_tokens > first.usage.input_tokens + len("sunny, 24 C") + len(call.arguments)
    # The stored response keeps its call: continuing from it renders the same prompt.
    follow = create(client, model, tools=FLAT, max_output_tokens=1, previous_response_id=first.id, input=[result])
    assert follow.usage.input_tokens == direct.usage.input_tokens
    assert client.responses.retrieve(first.id).output[0].call_id == call.call_id
    with pytest.raises(openai.BadRequestError) as caught:  # an output that answers no call
        create(client, model, tools=FLAT, previous_response_id=first.id, input=[{**result, "call_id": "call_x"}])
    assert caught.value.body["param"] == "input[0].call_id"


def test_streamed_call_events(client, model):
    stream = create(client, model, tools=FLAT, tool_choice="required", parallel_tool_calls=False, stream=True)
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(deltas),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    added, done, item_done, completed = events[2], events[-3], events[-2], events[-1]
    assert added.item.type == "function_call" and added.item.arguments == "" and added.output_index == 0
    assert {e.item_id for e in [*deltas, done]} == {added.item.id} == {item_done.item.id}
    assert "".join(d.delta for d in deltas) == done.arguments == item_done.item.arguments
    check_call(item_done.item)
    assert completed.response.output == [item_done.item]


def test_streamed_arguments_rebuild_the_non_streamed_call(client, model):
    """Greedy: the same answer streamed and not; the client's stream manager rebuilds the item."""
    kw = {"tools": FLAT, "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
          "temperature": 0.0}
    (whole,) = create(client, model, **kw).output
    with client.responses.stream(model=model, input=QUESTION, max_output_tokens=120, **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1  # streamed as written, not whole at the end
    (item,) = final.output
    assert "".join(d.delta for d in deltas) == item.arguments == whole.arguments
    assert item.name == whole.name == "get_weather" and check_call(item, "get_weather")
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.name == "get_weather" and added.item.arguments == "" and added.output_index == 0
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_call_cut_by_max_output_tokens_fails_the_stream(client, model):
    kw = {"tools": FLAT, "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 50}
    reply = create(client, model, **kw)
    assert reply.status == "incomplete" and [i.type for i in reply.output] == ["message"]  # the cut call is text
    events = list(create(client, model, **kw, stream=True))
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].code == "tool_call_incomplete" and events[-1].response.status == "failed"
    assert "response.function_call_arguments.done" not in [e.type for e in events]


def test_logprobs_with_the_include(client, model, byte_model_config):
    reply = create(client, model, include=[LOGPROBS], top_logprobs=2, temperature=0, max_output_tokens=12)
    (part,) = reply.output[0].content
    assert 0 < len(part.logprobs) <= reply.usage.output_tokens
    # Byte-level tokens: their bytes join into the text (random weights may write invalid UTF-8,
    # which decodes to U+FFFD in the text as here).
    joined = bytes(b for e in part.logprobs for b in e.bytes).decode(errors="replace")
    assert joined == part.text == reply.output_text
    for entry in part.logprobs:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
    streamed = list(create(client, model, include=[LOGPROBS], top_logprobs=2, temperature=0, max_output_tokens=12,
                           stream=True))
    deltas = [e for e in streamed if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == part.text
    entries = [entry for d in deltas for entry in d.logprobs]
    assert [e.token for e in entries] == [e.token for e in part.logprobs]
    # The same tokens; their values agree to float noise (the second run reads the cached prefix).
    want = [e.logprob for e in part.logprobs]
    atol = api_logprobs_atol(byte_model_config, reply.usage.input_tokens + len(want), want)
    assert [e.logprob for e in entries] == pytest.approx(want, abs=atol)
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_refusals(client, model, live_server):
    cases = [({"tools": [{"type": "web_search"}]}, "unsupported_parameter", "tools[0].type"),
             ({"tools": [{"type": "file_search", "vector_store_ids": ["vs"]}]}, "unsupported_parameter", "tools[0].type"),
             ({"include": ["file_search_call.results"]}, "unsupported_parameter", "include"),
             ({"top_logprobs": 2}, "invalid_request", "top_logprobs"),
             ({"tools": FLAT, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
              "conflicting_structured_outputs", "text.format"),
             ({"tools": FLAT, "tool_choice": {"type": "function", "name": "nope"}}, "invalid_request", "tool_choice"),
             ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "flip",
                                                             "arguments": '{"heads": "<|image_pad|>"}'}]},
              "image_placeholder_mismatch", "input[1].arguments"),
             ({"input": [{"type": "function_call", "call_id": "c", "name": "flip", "arguments": "{heads"}]},
              "invalid_request", "input[0].arguments"),
             ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
              "unsupported_parameter", "input[0].output[0]")]
    for extra, code, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            create(client, model, **extra)
        assert (caught.value.body["code"], caught.value.body["param"]) == (code, param), caught.value.body
    demo = live_server.client()
    for extra in ({"tools": FLAT}, {"input": [{"role": "user", "content": "hi"}, {
            "type": "function_call", "call_id": "c", "name": "flip", "arguments": "{}"}]}):
        with pytest.raises(openai.BadRequestError) as caught:
            demo.responses.create(model="fovea-shapes", **{"input": "hi", **extra})
        assert caught.value.body["code"] == "tools_not_supported", caught.value.body
