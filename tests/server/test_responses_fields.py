"""Every field of the /v1/responses schema (serve/responses/fields.py), sent with a value that is not
its default: honoured fields are shown to take effect, the others are refused with 400
``unsupported_parameter`` naming the field (or, for no-op fields, accepted at their no-op value)."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import httpx
import pytest
from openai.types.responses import response_create_params
from scene_helpers import data_url, fresh_scene

from fovea.demo import scenes
from fovea.serve.responses import fields as rf
from fovea.testing.tolerance import api_logprobs_atol

SCENE = fresh_scene(5000, min_shapes=2)
URL = data_url(scenes.render(SCENE))
ANSWER = scenes.describe_answer(SCENE)
QUESTION = "Describe the image."

NOOP_VALUES = {
    "user": "alice", "safety_identifier": "h", "prompt_cache_key": "k", "stream_options": {},
    "service_tier": "auto", "background": False, "truncation": "disabled",
    "reasoning": {}, "max_tool_calls": 3,
}
TOOL = {"type": "function", "name": "count", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}
LOGPROBS = "message.output_text.logprobs"


def user_input(url: str = URL, question: str = QUESTION) -> list:
    return [{"role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "auto"},
                                         {"type": "input_text", "text": question}]}]


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=120) as client:
        client.fovea_state = live_server.app.state.fovea  # the checks that look at what reached the engine
        yield client


@pytest.fixture(scope="module")
def post(http):
    def send(**extra) -> httpx.Response:
        return http.post("/v1/responses", json={"input": user_input(), **extra})
    return send


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text[:500]
    body = response.json()
    assert body["object"] == "response" and body["id"].startswith("resp_")
    return body


def text_of(body: dict) -> str:
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    return "".join(part["text"] for part in item["content"])


def refused(response: httpx.Response, param: str, code: str = "unsupported_parameter") -> None:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == param, error
    assert param.split(".")[0] in error["message"] and len(error["message"]) > 20, error


def tokenized(http, messages: list) -> int:
    reply = http.post("/tokenize", json={"messages": messages})
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


def chat_user(question: str = QUESTION) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}},
                                        {"type": "text", "text": question}]}


def events_of(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text[:500]
    out, kind = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            assert data["type"] == kind and data["sequence_number"] == len(out)
            out.append(data)
    return out


def _model(post, http):
    assert text_of(ok(post(model="fovea-shapes"))) == ANSWER
    response = post(model="gpt-4o")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def _input(post, http):
    body = ok(post(temperature=0))
    assert text_of(body) == ANSWER and body["status"] == "completed"
    # The prompt is the one chat renders for the same message: /tokenize counts it.
    assert body["usage"]["input_tokens"] == tokenized(http, [chat_user()])
    plain = ok(http.post("/v1/responses", json={"input": "How many shapes are there?"}))
    assert plain["usage"]["input_tokens"] == tokenized(http, [{"role": "user", "content": "How many shapes are there?"}])


def _instructions(post, http):
    body = ok(post(instructions="Answer briefly."))
    assert body["instructions"] == "Answer briefly."
    want = tokenized(http, [{"role": "system", "content": "Answer briefly."}, chat_user()])
    assert body["usage"]["input_tokens"] == want > tokenized(http, [chat_user()])


def _max_output_tokens(post, http):
    body = ok(post(max_output_tokens=2))
    assert body["usage"]["output_tokens"] == 2 and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"} and body["max_output_tokens"] == 2


def sampled_with(http, call) -> list:
    """The engine's SamplingParams of each request ``call`` makes (the Responses API has no seed,
    so what reaches the sampler is checked, and the sampler itself by the chat tests)."""
    engine = http.fovea_state.engine
    submit, seen = engine.submit, []  # every request reaches the engine through submit

    def spy(prompt, params, *args, **kwargs):
        seen.append(params)
        return submit(prompt, params, *args, **kwargs)

    engine.submit = spy
    try:
        call()
    finally:
        engine.submit = submit
    return seen


def _temperature(post, http):
    (params,) = sampled_with(http, lambda: ok(post(temperature=1.5, max_output_tokens=8)))
    assert params.temperature == 1.5 and not params.greedy
    (params,) = sampled_with(http, lambda: ok(post(temperature=0)))
    assert params.greedy
    body = ok(post(temperature=1.5, max_output_tokens=8))
    assert body["temperature"] == 1.5


def _top_p(post, http):
    greedy = text_of(ok(post(temperature=0, max_output_tokens=8)))
    for _ in range(4):  # a tiny nucleus keeps only the top token: greedy even at temperature 2
        body = ok(post(temperature=2.0, top_p=1e-6, max_output_tokens=8))
        assert text_of(body) == greedy and body["top_p"] == 1e-6 and body["temperature"] == 2.0


def _stream(post, http):
    events = events_of(post(stream=True))
    kinds = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and len(deltas) > 3
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.completed"]
    assert "".join(deltas) == ANSWER == events[-4]["text"] == text_of(events[-1]["response"])
    assert events[-1]["response"]["usage"]["output_tokens"] > 0


def _store(post, http):
    body = ok(post(store=True))
    assert body["store"] is True
    assert http.get(f"/v1/responses/{body['id']}").json() == body
    unstored = ok(post())
    assert unstored["store"] is False and http.get(f"/v1/responses/{unstored['id']}").status_code == 404


def _previous_response_id(post, http):
    first = ok(post(store=True, instructions="Be terse."))
    follow = ok(http.post("/v1/responses", json={"input": "How many shapes are there?",
                                                 "previous_response_id": first["id"]}))
    assert follow["previous_response_id"] == first["id"]
    # The follow-up's prompt is the whole conversation (the first turn's instructions not carried over).
    want = tokenized(http, [chat_user(), {"role": "assistant", "content": text_of(first)},
                            {"role": "user", "content": "How many shapes are there?"}])
    assert follow["usage"]["input_tokens"] == want
    missing = http.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_nothere"})
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "response_not_found"
    assert missing.json()["error"]["param"] == "previous_response_id"


def _metadata(post, http):
    assert ok(post(metadata={"k": "v"}))["metadata"] == {"k": "v"}
    refused(post(metadata={f"k{i}": "v" for i in range(17)}), "metadata", code="invalid_request")


def _text(post, http):
    # Free text changes nothing; a JSON format reaches the grammar compiler, which refuses it here
    # (the demo model's word-level vocabulary cannot spell JSON; tests/compat shows JSON answers);
    # a malformed format and verbosity are refused by name.
    assert text_of(ok(post(temperature=0, text={"format": {"type": "text"}}))) == ANSWER
    refused(post(text={"format": {"type": "json_object"}}), "text.format", code="grammar_unsatisfiable")
    refused(post(text={"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}),
            "text.format.schema", code="grammar_unsatisfiable")
    refused(post(text={"format": {"type": "json_schema", "schema": {}}}), "text.format", code="invalid_request")
    refused(post(text={"format": {"type": "xml"}}), "text.format", code="invalid_request")
    refused(post(text={"verbosity": "low"}), "text")


# The demo model's template renders no tools: these checks show the refusals and what changes
# without a tool template; tests/compat/test_openai_responses_tools.py shows calls being made.
def _tools(post, http):
    refused(post(tools=[TOOL]), "tools", code="tools_not_supported")
    refused(post(tools=[{"type": "web_search"}]), "tools[0].type")
    refused(post(tools=[TOOL, {"type": "mcp", "server_label": "x"}]), "tools[1].type")
    refused(post(tools=[{**TOOL, "defer_loading": True}]), "tools[0].defer_loading")
    assert ok(post(tools=[]))["tools"] == []


def _tool_choice(post, http):
    plain = ok(post(temperature=0))
    disabled = ok(post(temperature=0, tools=[TOOL], tool_choice="none"))  # tools not rendered: the same prompt
    assert disabled["usage"]["input_tokens"] == plain["usage"]["input_tokens"] and text_of(disabled) == ANSWER
    assert disabled["tool_choice"] == "none" and disabled["tools"] == [TOOL]
    refused(post(tool_choice="required"), "tool_choice", code="invalid_request")  # needs tools
    refused(post(tools=[TOOL], tool_choice={"type": "allowed_tools", "mode": "auto", "tools": []}), "tool_choice")
    refused(post(tools=[TOOL], tool_choice="sometimes"), "tool_choice", code="invalid_request")


def _parallel_tool_calls(post, http):
    assert ok(post(parallel_tool_calls=False))["parallel_tool_calls"] is False
    refused(post(tools=[TOOL], parallel_tool_calls=False), "tools", code="tools_not_supported")


def chat_logprobs(http, top: int) -> list:
    reply = http.post("/v1/chat/completions", json={"messages": [chat_user()], "temperature": 0, "logprobs": True,
                                                    "top_logprobs": top})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["logprobs"]["content"]


def same_entries(http, got: list, want: list) -> bool:
    """Log-probability entries equal but for float noise (a prompt read from the prefix cache)."""
    def plain(entries):
        return [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]) for e in entries]

    def values(entries):
        return [v for e in entries for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]
    context = tokenized(http, [chat_user()]) + len(want)
    atol = api_logprobs_atol(http.fovea_state.loaded.model.config, context, values(want))
    return plain(got) == plain(want) and values(got) == pytest.approx(values(want), abs=atol)


def part_of(body: dict) -> dict:
    (item,) = body["output"]
    (part,) = item["content"]
    return part


def _include(post, http):
    part = part_of(ok(post(temperature=0, include=[LOGPROBS])))
    # The same entries as chat's for the same prompt: the text's tokens, each with its bytes.
    assert same_entries(http, part["logprobs"], chat_logprobs(http, 0)) and len(part["logprobs"]) > 3
    assert len(part["logprobs"]) == len(ANSWER.split()) and part["text"] == ANSWER  # a word-level vocabulary
    assert all(e["top_logprobs"] == [] and e["logprob"] <= 0 and bytes(e["bytes"]).decode() == e["token"]
               for e in part["logprobs"])
    assert part_of(ok(post(temperature=0)))["logprobs"] == []  # only when asked
    events = events_of(post(temperature=0, stream=True, include=[LOGPROBS]))
    streamed = [e for ev in events if ev["type"] == "response.output_text.delta" for e in ev["logprobs"]]
    assert streamed == part_of(events[-1]["response"])["logprobs"]
    assert same_entries(http, streamed, part["logprobs"])
    refused(post(include=["reasoning.encrypted_content"]), "include")
    refused(post(include=[LOGPROBS, "message.input_image.image_url"]), "include")


def _top_logprobs(post, http):
    body = ok(post(temperature=0, include=[LOGPROBS], top_logprobs=3))
    assert body["top_logprobs"] == 3
    entries = part_of(body)["logprobs"]
    assert same_entries(http, entries, chat_logprobs(http, 3))
    for e in entries:
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] >= e["logprob"]
        assert [t["logprob"] for t in e["top_logprobs"]] == sorted((t["logprob"] for t in e["top_logprobs"]),
                                                                    reverse=True)
    refused(post(top_logprobs=2), "top_logprobs", code="invalid_request")  # OpenAI needs the include too
    refused(post(include=[LOGPROBS], top_logprobs=21), "top_logprobs", code="invalid_request")
    assert ok(post(top_logprobs=0))["top_logprobs"] == 0


HONOURED_CHECKS = {
    "tools": _tools, "tool_choice": _tool_choice, "parallel_tool_calls": _parallel_tool_calls,
    "include": _include, "top_logprobs": _top_logprobs,
    "model": _model, "input": _input, "instructions": _instructions, "max_output_tokens": _max_output_tokens,
    "temperature": _temperature, "top_p": _top_p, "stream": _stream, "store": _store,
    "previous_response_id": _previous_response_id, "metadata": _metadata, "text": _text,
}


def test_the_table_covers_the_openai_schema_and_every_field_has_a_check():
    schema = set(typing.get_type_hints(response_create_params.ResponseCreateParamsBase)) | {"stream"}
    assert {f.name for f in rf.FIELDS} == schema
    assert set(HONOURED_CHECKS) == {f.name for f in rf.FIELDS if f.status == rf.HONOURED}
    assert set(NOOP_VALUES) == {f.name for f in rf.FIELDS if f.status == rf.NOOP}
    for f in rf.FIELDS:
        assert f.example is not None or f.name == "input", f.name


@pytest.mark.parametrize("field", rf.FIELDS, ids=[f.name for f in rf.FIELDS])
def test_field(post, http, field):
    if field.status == rf.HONOURED:
        HONOURED_CHECKS[field.name](post, http)
        return
    extra = {"stream": True} if field.name == "stream_options" else {}
    if field.status == rf.NOOP:
        value = NOOP_VALUES[field.name]
        if extra:
            events = events_of(post(temperature=0, **extra, **{field.name: value}))
            assert text_of(events[-1]["response"]) == ANSWER
        else:
            assert text_of(ok(post(temperature=0, **{field.name: value}))) == ANSWER  # accepted, changed nothing
    if field.refuses(field.example):
        refused(post(**extra, **{field.name: field.example}), field.name)
    else:  # user, safety_identifier, prompt_cache_key: any string is a no-op
        assert text_of(ok(post(temperature=0, **{field.name: field.example}))) == ANSWER


def test_unknown_fields_and_items_are_refused(post, http):
    refused(post(frobnicate=1), "frobnicate")
    refused(post(max_tokens=4), "max_tokens")  # chat's name: refused, not quietly ignored
    refused(post(stream_options={}), "stream_options", code="invalid_request")  # without stream
    refused(post(stream=True, stream_options={"include_obfuscation": True}), "stream_options")
    refused(http.post("/v1/responses", json={"input": [{"type": "item_reference", "id": "msg_1"}]}), "input[0].type")
    refused(http.post("/v1/responses", json={"input": [{"type": "function_call_output", "call_id": "c",
                                                        "output": "x"}]}), "input[0]", code="tools_not_supported")


def _with(item: dict, **extra) -> list:
    return [{**item, **extra}]


IMAGE_PART = {"type": "input_image", "image_url": URL}
# An unknown key at every depth of input: refused naming its path, as chat's nested keys are.
NESTED_UNKNOWN = [
    (_with(user_input()[0], frobnicate=1), "input[0].frobnicate"),
    ([{"role": "user", "content": [{**IMAGE_PART, "frobnicate": 1}]}], "input[0].content[0].frobnicate"),
    ([{"role": "user", "content": [{"type": "input_text", "text": "hi", "x": 1}]}], "input[0].content[0].x"),
    ([*user_input(), {"role": "assistant", "content": [{"type": "output_text", "text": "a", "x": 1}]}],
     "input[1].content[0].x"),
    ([*user_input(), {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "x": 1}], "input[1].x"),
    ([*user_input(), {"type": "function_call_output", "call_id": "c", "output": "1", "x": 1}], "input[1].x"),
]


@pytest.mark.parametrize(("items", "param"), NESTED_UNKNOWN, ids=[p for _, p in NESTED_UNKNOWN])
def test_unknown_nested_keys_are_refused_naming_their_path(http, items, param):
    refused(http.post("/v1/responses", json={"input": items}), param)


def test_output_items_sent_back_as_input_keep_their_ids_with_no_effect(post, http):
    """``input += response.output`` (OpenAI's guides): the items' id and status, and the text part's
    annotations and logprobs, describe the earlier answer and change nothing."""
    first = ok(post(temperature=0))
    bare = [{"role": "assistant", "content": [{"type": "output_text", "text": text_of(first)}]}]
    turns = [*user_input(), *first["output"], *user_input()]
    assert first["output"][0]["id"] and first["output"][0]["status"] == "completed"
    assert set(first["output"][0]["content"][0]) >= {"annotations", "logprobs"}
    again = ok(http.post("/v1/responses", json={"input": turns, "temperature": 0}))
    plain = ok(http.post("/v1/responses", json={"input": [*user_input(), *bare, *user_input()], "temperature": 0}))
    assert text_of(again) == text_of(plain) and again["usage"] == plain["usage"]


def test_aiperf_stream_options_are_accepted(post):
    events = events_of(post(temperature=0, stream=True, stream_options={"include_usage": True}))
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["usage"]["input_tokens"] > 64


def test_docs_list_every_field():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    block = f"<!-- fields:{rf.RESPONSES} -->\n{rf.markdown_table()}\n<!-- /fields:{rf.RESPONSES} -->"
    assert block in doc, "docs/api.md is out of date: python -m fovea.serve.responses.fields prints the table"
