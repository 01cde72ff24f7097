"""Every field of the chat and completions schemas (serve/fields.py), sent with a value that is not
its default: honoured fields are shown to take effect, the others are refused with 400
``unsupported_parameter`` naming the field (or, for no-op fields, accepted at their no-op value)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import httpx
import openai
import pytest
import transformers
from scene_helpers import data_url, fresh_scene

from fovea.demo import scenes
from fovea.loading.loader import default_model_dir
from fovea.serve import fields

SCENE = fresh_scene(5000, min_shapes=2)
URL = data_url(scenes.render(SCENE))
ANSWER = scenes.describe_answer(SCENE)
PATHS = {fields.CHAT: "/v1/chat/completions", fields.COMPLETIONS: "/v1/completions"}
ENDPOINTS = [fields.CHAT, fields.COMPLETIONS]

# Values that change nothing, which no-op fields must accept (the table says which values pass).
NOOP_VALUES = {
    "user": "alice", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
    "modalities": ["text"], "echo": False, "best_of": 1, "suffix": "",
}


def base(endpoint: str, **extra) -> dict:
    if endpoint == fields.CHAT:
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}},
                                                          {"type": "text", "text": "Describe the image."}]}]}
    else:
        body = {"prompt": "user: <image> Describe the image. assistant:", "images": [URL]}
    return {**body, **extra}


def text_of(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.fixture(scope="module")
def post(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=120) as http:
        def send(endpoint: str, **extra) -> httpx.Response:
            return http.post(PATHS[endpoint], json=base(endpoint, **extra))
        yield send


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text[:500]
    return response.json()


def refused(response: httpx.Response, param: str, code: str = "unsupported_parameter") -> None:
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == param, error
    assert param in error["message"] and len(error["message"]) > 20, error


def greedy_tokens(post, ep) -> int:
    return ok(post(ep, temperature=0))["usage"]["completion_tokens"]


def _model(post, ep):
    assert text_of(ok(post(ep, model="fovea-shapes"))) == ANSWER
    response = post(ep, model="gpt-4o")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def _content(post, ep):  # messages / prompt / images: the answer describes the image sent
    assert text_of(ok(post(ep, temperature=0))) == ANSWER


def _max_tokens(name):
    def check(post, ep):
        body = ok(post(ep, **{name: 2}))
        assert body["usage"]["completion_tokens"] == 2 and body["choices"][0]["finish_reason"] == "length"
    return check


def _temperature(post, ep):
    answers = {text_of(ok(post(ep, temperature=2.0, seed=s, max_tokens=8))) for s in range(6)}
    assert len(answers) > 1  # sampling at 2.0 is not the greedy answer every time


def _top_p(post, ep):
    greedy = text_of(ok(post(ep, temperature=0, max_tokens=8)))
    for s in range(4):  # a tiny nucleus keeps only the top token: greedy even at temperature 2
        assert text_of(ok(post(ep, temperature=2.0, top_p=1e-6, seed=s, max_tokens=8))) == greedy


def _seed(post, ep):
    a, b = (text_of(ok(post(ep, temperature=2.0, seed=11, max_tokens=10))) for _ in range(2))
    assert a == b


def _stop(post, ep):
    body = ok(post(ep, temperature=0, stop=[" and"]))
    assert text_of(body) == ANSWER.split(" and")[0] and body["choices"][0]["finish_reason"] == "stop"


def _events(response: httpx.Response) -> list:
    assert response.status_code == 200, response.text[:500]
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _stream(post, ep):
    chunks = _events(post(ep, temperature=0, stream=True))
    pieces = [c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or "" for c in chunks]
    assert "".join(pieces) == ANSWER and len(chunks) > 3


def _stream_options(post, ep):
    chunks = _events(post(ep, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    refused(post(ep, stream_options={"include_usage": True}), "stream_options", code="invalid_request")


def _n(post, ep):
    one = ok(post(ep, temperature=0))
    body = ok(post(ep, temperature=0, n=3))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2] and {text_of({"choices": [c]}) for c in body["choices"]} \
        == {ANSWER}
    assert body["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    seeded = [[text_of({"choices": [c]}) for c in ok(post(ep, temperature=2.0, seed=5, n=3, max_tokens=8))["choices"]]
              for _ in range(2)]
    assert seeded[0] == seeded[1]  # each choice reproducible
    assert seeded[0][0] == text_of(ok(post(ep, temperature=2.0, seed=5, max_tokens=8)))  # choice 0 is seed's answer
    refused(post(ep, n=129), "n", code="invalid_request")


def _entries(body: dict) -> tuple[list[float], list]:
    """(sampled tokens' logprobs, their alternatives) in either endpoint's shape."""
    lp = body["choices"][0]["logprobs"]
    if "content" in lp:
        return [e["logprob"] for e in lp["content"]], [e["top_logprobs"] for e in lp["content"]]
    return lp["token_logprobs"], lp["top_logprobs"]


def _logprobs(post, ep):
    body = ok(post(ep, temperature=0, logprobs=True if ep == fields.CHAT else 2))
    chosen, _ = _entries(body)
    assert len(chosen) == body["usage"]["completion_tokens"] - 1  # all but the end-of-sequence token
    assert all(lp <= 0 for lp in chosen) and max(chosen) > -1  # greedy: the likely tokens
    assert ok(post(ep, temperature=0))["choices"][0]["logprobs"] is None
    # Each endpoint's own spelling only: chat takes a boolean, completions an integer 0..20.
    refused(post(ep, logprobs=2 if ep == fields.CHAT else True), "logprobs", code="invalid_request")
    if ep == fields.COMPLETIONS:
        refused(post(ep, logprobs=21), "logprobs", code="invalid_request")


def _prompt_logprobs(post, ep):  # the layout, n and the refusals: test_prompt_logprobs.py
    body = ok(post(ep, temperature=0, prompt_logprobs=2))
    entries = body["prompt_logprobs"] if ep == fields.CHAT else body["choices"][0]["prompt_logprobs"]
    assert len(entries) == body["usage"]["prompt_tokens"] and entries[0] is None
    assert all(len(entry) in (2, 3) for entry in entries[1:]) and text_of(body) == ANSWER
    refused(post(ep, prompt_logprobs=21), "prompt_logprobs", code="invalid_prompt_logprobs")


def _top_logprobs(post, ep):
    body = ok(post(ep, temperature=0, logprobs=True, top_logprobs=3))
    chosen, tops = _entries(body)
    for lp, top in zip(chosen, tops):
        values = [t["logprob"] for t in top]
        assert len(top) == 3 and values == sorted(values, reverse=True) and values[0] == lp  # greedy: the top one
    refused(post(ep, logprobs=True, top_logprobs=21), "top_logprobs", code="invalid_request")
    refused(post(ep, top_logprobs=2), "top_logprobs", code="invalid_request")


def _changes_sampling(post, ep, **penalty):
    """Seeded sampling at temperature 2 over 24 tokens gives another answer with the penalty, for some seed."""
    def answers(**extra):
        return [text_of(ok(post(ep, temperature=2.0, seed=s, max_tokens=24, ignore_eos=True, **extra)))
                for s in range(4)]
    assert answers(**penalty) != answers()


def _presence_penalty(post, ep):
    _changes_sampling(post, ep, presence_penalty=2.0)
    refused(post(ep, presence_penalty=2.5), "presence_penalty", code="invalid_request")


def _frequency_penalty(post, ep):
    _changes_sampling(post, ep, frequency_penalty=2.0)
    refused(post(ep, frequency_penalty=-3), "frequency_penalty", code="invalid_request")


def _repetition_penalty(post, ep):
    assert text_of(ok(post(ep, temperature=0, repetition_penalty=50.0))) != ANSWER
    refused(post(ep, repetition_penalty=0), "repetition_penalty", code="invalid_request")


@functools.cache
def _tokenizer():
    return transformers.AutoTokenizer.from_pretrained(default_model_dir())


def _logit_bias(post, ep):
    red = _tokenizer().convert_tokens_to_ids("red")
    body = ok(post(ep, temperature=0, max_tokens=3, logit_bias={str(red): 100}))
    assert text_of(body) == "red red red"
    refused(post(ep, logit_bias={"100000": 1}), "logit_bias", code="invalid_request")
    refused(post(ep, logit_bias={"7": 101}), "logit_bias[7]", code="invalid_request")


def _stop_token_ids(post, ep):
    # The greedy answer's third word as a stop token: the answer is its first two words, the
    # stop token counted but not in the text.
    third = _tokenizer().convert_tokens_to_ids(ANSWER.split()[2])
    stopped = ok(post(ep, temperature=0, stop_token_ids=[third]))
    assert text_of(stopped) == " ".join(ANSWER.split()[:2]) and stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 3
    refused(post(ep, stop_token_ids=[100000]), "stop_token_ids", code="invalid_request")


def _top_k(post, ep):
    for s in range(4):  # top-k 1 keeps only the top token: greedy even at temperature 2
        assert text_of(ok(post(ep, temperature=2.0, top_k=1, seed=s))) == ANSWER
    refused(post(ep, top_k=-2), "top_k", code="invalid_request")


def _min_p(post, ep):
    for s in range(4):  # min-p 1 keeps only the top token
        assert text_of(ok(post(ep, temperature=2.0, min_p=1.0, seed=s))) == ANSWER
    refused(post(ep, min_p=1.5), "min_p", code="invalid_request")


def _ignore_eos(post, ep):
    want = greedy_tokens(post, ep) + 5
    body = ok(post(ep, temperature=0, ignore_eos=True, max_tokens=want))
    assert body["usage"]["completion_tokens"] == want


def _min_tokens(post, ep):
    least = greedy_tokens(post, ep) + 3
    body = ok(post(ep, temperature=0, min_tokens=least, max_tokens=least + 20))
    assert body["usage"]["completion_tokens"] >= least


def _fovea(post, ep):
    body = ok(post(ep, fovea={"grounding": True}, max_tokens=4))
    assert "image_dependent" in body["fovea"]["grounding"]
    refused(post(ep, fovea={"grounding": True}, n=2), "n", code="invalid_request")  # it scores one answer


def _add_special_tokens(post, ep):
    """The demo's tokenizer adds a BOS and its template writes one: completions lose it with
    false, chat gets a second one with true; unset is each endpoint's default."""
    def prompt_tokens(**extra) -> int:
        return ok(post(ep, max_tokens=1, **extra))["usage"]["prompt_tokens"]
    default = prompt_tokens()
    if ep == fields.CHAT:
        assert prompt_tokens(add_special_tokens=True) == default + 1
        assert prompt_tokens(add_special_tokens=False) == default
    else:
        assert prompt_tokens(add_special_tokens=False) == default - 1
        assert prompt_tokens(add_special_tokens=True) == default
    refused(post(ep, add_special_tokens="no"), "add_special_tokens", code="invalid_request")


def _unsatisfiable(name, value):
    def check(post, ep):  # the demo model's word-level vocabulary cannot spell JSON: refused, not ignored
        refused(post(ep, **{name: value}), name, code="grammar_unsatisfiable")
        if name == "response_format":
            assert text_of(ok(post(ep, temperature=0, response_format={"type": "text"}))) == ANSWER
    return check


def _one_of(name, value):
    def check(post, ep):
        body = ok(post(ep, temperature=2.0, seed=3, **{name: value}))
        assert text_of(body) in ("yes", "no") and body["choices"][0]["finish_reason"] == "stop"
    return check


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _no_tools_here(name, value, param=None):
    def check(post, ep):  # the demo model's template renders no tools: refused, not ignored
        refused(post(ep, **{name: value}), param or name, code="tools_not_supported")
        assert text_of(ok(post(ep, temperature=0, tools=[], tool_choice="none"))) == ANSWER  # none asked
    return check


def _tool_choice(post, ep):
    assert text_of(ok(post(ep, temperature=0, tool_choice="none"))) == ANSWER
    refused(post(ep, tool_choice="required"), "tool_choice", code="invalid_request")  # no tools to require
    refused(post(ep, tools=[TOOL], tool_choice="required"), "tools", code="tools_not_supported")


HONOURED_CHECKS = {
    "model": _model, "messages": _content, "prompt": _content, "images": _content,
    "max_tokens": _max_tokens("max_tokens"), "max_completion_tokens": _max_tokens("max_completion_tokens"),
    "temperature": _temperature, "top_p": _top_p, "seed": _seed, "stop": _stop, "stream": _stream,
    "stream_options": _stream_options, "n": _n, "ignore_eos": _ignore_eos, "min_tokens": _min_tokens,
    "fovea": _fovea, "add_special_tokens": _add_special_tokens, "logprobs": _logprobs,
    "top_logprobs": _top_logprobs, "prompt_logprobs": _prompt_logprobs, "presence_penalty": _presence_penalty,
    "frequency_penalty": _frequency_penalty, "repetition_penalty": _repetition_penalty, "logit_bias": _logit_bias,
    "stop_token_ids": _stop_token_ids, "top_k": _top_k, "min_p": _min_p,
    "response_format": _unsatisfiable("response_format", {"type": "json_object"}),
    "guided_json": _unsatisfiable("guided_json", {"type": "object"}),
    "structured_outputs": _one_of("structured_outputs", {"choice": ["yes", "no"]}),
    "guided_choice": _one_of("guided_choice", ["yes", "no"]), "guided_regex": _one_of("guided_regex", "(yes|no)"),
    "guided_grammar": _one_of("guided_grammar", 'root ::= "yes" | "no"'),
    "tools": _no_tools_here("tools", [TOOL]), "tool_choice": _tool_choice,
    "parallel_tool_calls": lambda post, ep: refused(post(ep, tools=[TOOL], parallel_tool_calls=False), "tools",
                                                    code="tools_not_supported"),
    "functions": _no_tools_here("functions", [TOOL["function"]]),
    "function_call": lambda post, ep: refused(post(ep, functions=[TOOL["function"]], function_call={"name": "f"}),
                                              "functions", code="tools_not_supported"),
}


def test_every_field_has_a_check():
    honoured = {f.name for f in fields.FIELDS if f.status == fields.HONOURED}
    assert set(HONOURED_CHECKS) == honoured
    noop = {f.name for f in fields.FIELDS if f.status == fields.NOOP}
    assert set(NOOP_VALUES) == noop
    for f in fields.FIELDS:
        assert f.example is not None or f.status == fields.HONOURED, f.name


CASES = [(ep, f) for ep in ENDPOINTS for f in fields.fields_for(ep)]


@pytest.mark.parametrize(("endpoint", "field"), CASES, ids=[f"{ep}-{f.name}" for ep, f in CASES])
def test_field(post, endpoint, field):
    if field.status == fields.HONOURED:
        HONOURED_CHECKS[field.name](post, endpoint)
        return
    if field.status == fields.NOOP:
        body = ok(post(endpoint, temperature=0, **{field.name: NOOP_VALUES[field.name]}))
        assert text_of(body) == ANSWER  # accepted, and it changed nothing
    if field.refuses(field.example):
        refused(post(endpoint, **{field.name: field.example}), field.name)
    else:  # user and metadata: any value is a no-op
        assert text_of(ok(post(endpoint, temperature=0, **{field.name: field.example}))) == ANSWER


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_unknown_and_other_endpoint_fields_are_refused(post, endpoint):
    refused(post(endpoint, frobnicate=1), "frobnicate")
    other, value = ("suffix", "") if endpoint == fields.CHAT else ("tools", [])
    refused(post(endpoint, **{other: value}), other)
    refused(post(endpoint, stream=True, stream_options={"frobnicate": True}), "stream_options.frobnicate")
    for name, value in (("user", 5), ("metadata", ["x"])):  # no-op at any value of the right type only
        refused(post(endpoint, **{name: value}), name, code="invalid_request")


def _image_part(**extra) -> dict:
    return {"type": "image_url", "image_url": {"url": URL, **extra}}


def _chat(*messages: dict) -> dict:
    return {"messages": list(messages)}


def _user(*parts: dict, **extra) -> dict:
    return {"role": "user", "content": [_image_part(), {"type": "text", "text": "Describe the image."}, *parts],
            **extra}


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
# An unknown key at every depth of a chat body: refused like a top-level one, naming its path.
NESTED_UNKNOWN = [
    (_chat(_user(frobnicate=1)), "messages[0].frobnicate"),
    (_chat({"role": "user", "content": [{"type": "text", "text": "hi", "frobnicate": 1}]}),
     "messages[0].content[0].frobnicate"),
    (_chat({"role": "user", "content": [{**_image_part(), "frobnicate": 1}]}), "messages[0].content[0].frobnicate"),
    (_chat({"role": "user", "content": [_image_part(frobnicate=1)]}), "messages[0].content[0].image_url.frobnicate"),
    (_chat({"role": "user", "content": [{"type": "video_url", "video_url": {"url": URL, "fps": 2}}]}),
     "messages[0].content[0].video_url.fps"),
    (_chat({"role": "user", "content": [{"type": "video_url", "video_url": {"url": URL}, "x": 1}]}),
     "messages[0].content[0].x"),
    (_chat(_user(), {"role": "assistant", "content": "a", "tool_calls": [{**CALL, "index": 0}]}),
     "messages[1].tool_calls[0].index"),
    (_chat(_user(), {"role": "assistant", "content": "a", "tool_calls": [
        {**CALL, "function": {**CALL["function"], "x": 1}}]}), "messages[1].tool_calls[0].function.x"),
    # Keys OpenAI's SDK types for an assistant message, which fovea takes only as null.
    (_chat(_user(), {"role": "assistant", "content": "a", "refusal": "no"}, _user()), "messages[1].refusal"),
    (_chat(_user(), {"role": "assistant", "content": "a", "audio": {"id": "a1"}}, _user()), "messages[1].audio"),
    (_chat(_user(), {"role": "assistant", "content": "a", "function_call": {"name": "f", "arguments": "{}"}},
           _user()), "messages[1].function_call"),
]


@pytest.mark.parametrize(("body", "param"), NESTED_UNKNOWN, ids=[p for _, p in NESTED_UNKNOWN])
def test_unknown_nested_keys_are_refused_naming_their_path(live_server, body, param):
    with httpx.Client(base_url=live_server.base_url, timeout=120) as http:
        refused(http.post(PATHS[fields.CHAT], json=body), param)
        refused(http.post("/tokenize", json=body), param)  # it reads messages through the same schema


def test_nested_keys_the_sdk_sends_as_null_change_nothing(live_server):
    question = _user()
    plain = _chat(question, {"role": "assistant", "content": ANSWER}, question)
    nulls = _chat(question, {"role": "assistant", "content": ANSWER, "refusal": None, "audio": None,
                             "function_call": None, "annotations": None, "name": None}, question)
    with httpx.Client(base_url=live_server.base_url, timeout=120) as http:
        a, b = (ok(http.post(PATHS[fields.CHAT], json={**body, "temperature": 0})) for body in (plain, nulls))
    assert text_of(a) == text_of(b) and a["usage"] == b["usage"]
    # The openai client's own round trip: an answer's message sent back, as the object and dumped.
    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    first = client.chat.completions.create(model="fovea-shapes", messages=[question], temperature=0)
    for previous in (first.choices[0].message, first.choices[0].message.model_dump()):
        again = client.chat.completions.create(model="fovea-shapes", messages=[question, previous, question],
                                               temperature=0)
        assert again.choices[0].message.content == text_of(b) and again.usage.prompt_tokens == \
            b["usage"]["prompt_tokens"]


def test_docs_list_every_field():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    for ep in ENDPOINTS:
        block = f"<!-- fields:{ep} -->\n{fields.markdown_table(ep)}\n<!-- /fields:{ep} -->"
        assert block in doc, f"docs/api.md is out of date: python -m fovea.serve.fields prints the {ep} table"
