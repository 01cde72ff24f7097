"""A request without max_tokens gets what the server's per-sequence limit leaves after its prompt
(vLLM's rule): never a refusal for a max_tokens nobody sent, on every endpoint and under
--max-model-len or a KV cache smaller than the model's context."""

from __future__ import annotations

import json

import httpx
import pytest
from scene_helpers import data_url, fresh_scene

from fovea.demo import scenes

URL = data_url(scenes.render(fresh_scene(23_001)))
QUESTION = "Describe the image."
MESSAGES = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}},
                                         {"type": "text", "text": QUESTION}]}]
LIMIT = 200  # --max-model-len, well under the demo model's context of 512


@pytest.fixture(scope="module")
def short(make_server):
    live = make_server(max_model_len=LIMIT)
    assert live.app.state.fovea.engine.max_context == LIMIT
    with httpx.Client(base_url=live.base_url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def small_cache(make_server, demo_model):
    """A KV cache that holds fewer tokens than the model's context, and no --max-model-len."""
    live = make_server(kv_cache_memory=2 * 2**20)
    limit = live.app.state.fovea.engine.max_context
    assert limit < demo_model.context_length  # else this server tests nothing
    with httpx.Client(base_url=live.base_url, timeout=300) as client:
        yield client, limit


def test_chat_without_max_tokens_answers_within_the_limit(short):
    reply = short.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["total_tokens"] <= LIMIT


def test_the_default_is_the_limit_minus_the_prompt(short):
    """ignore_eos makes the answer run to its length: exactly what the limit leaves."""
    body = short.post("/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True}).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == LIMIT


def test_n_choices_each_get_the_default(short):
    body = short.post("/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True, "n": 2}).json()
    prompt = body["usage"]["prompt_tokens"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"]["completion_tokens"] == 2 * (LIMIT - prompt)


def test_a_kv_cache_smaller_than_the_context_sets_the_default(small_cache):
    client, limit = small_cache
    body = client.post("/v1/chat/completions", json={"messages": MESSAGES, "ignore_eos": True}).json()
    assert body["choices"][0]["finish_reason"] == "length", body
    assert body["usage"]["total_tokens"] == limit


def test_completions_without_max_tokens(short):
    reply = short.post("/v1/completions", json={"prompt": "user: <image> Describe the image. assistant:",
                                                 "images": [URL], "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["total_tokens"] == LIMIT


def test_generate_without_max_tokens(short):
    reply = short.post("/generate", json={"prompt": QUESTION, "image": URL, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["finish_reason"] == "length" and body["usage"]["total_tokens"] == LIMIT


def test_responses_without_max_output_tokens(short):
    reply = short.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": URL}, {"type": "input_text", "text": QUESTION}]}]})
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    assert usage["total_tokens"] <= LIMIT


def test_a_stream_without_max_tokens(short):
    with short.stream("POST", "/v1/chat/completions", json={
            "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}) as reply:
        assert reply.status_code == 200
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
    assert chunks[-1]["usage"]["total_tokens"] <= LIMIT


@pytest.fixture(scope="module")
def tiny(make_server):
    return make_server(max_model_len=40)  # the image alone is more than 40 tokens


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses"])
def test_a_prompt_that_leaves_no_room_is_refused_naming_the_prompt(tiny, assert_error, path):
    body = {"/v1/chat/completions": {"messages": MESSAGES},
            "/v1/completions": {"prompt": "user: <image> Describe the image. assistant:", "images": [URL]},
            "/generate": {"prompt": QUESTION, "image": URL},
            "/v1/responses": {"input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": URL}, {"type": "input_text", "text": QUESTION}]}]}}[path]
    error = assert_error(httpx.post(tiny.base_url + path, json=body, timeout=120), 400, "context_length_exceeded",
                         param=None)
    assert error["message"].startswith("the prompt has ") and "limit is 40 tokens per sequence" in error["message"]
    assert "max_tokens" not in error["message"] and "max_output_tokens" not in error["message"]


def test_an_explicit_max_tokens_that_overflows_is_still_named(short, assert_error):
    error = assert_error(short.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": LIMIT}),
                         400, "context_length_exceeded", param="max_tokens")
    assert f"max_tokens is {LIMIT}" in error["message"]
