"""The small endpoints: /version, HEAD /metrics, /tokenize and /detokenize (vLLM's shapes), and
stream_options without stream through the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest
from scene_helpers import data_url, fresh_scene

from fovea import __version__
from fovea.demo import scenes

SCENE = fresh_scene(6000, min_shapes=2)
URL = data_url(scenes.render(SCENE))
PROMPT = "user: <image> Describe the image. assistant:"
MESSAGES = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": URL}},
                                         {"type": "text", "text": "Describe the image."}]}]


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_version(http):
    response = http.get("/version")
    assert response.status_code == 200 and response.json() == {"version": __version__}


def test_head_metrics_is_get_without_a_body(http):
    get, head = http.get("/metrics"), http.head("/metrics")
    assert get.status_code == head.status_code == 200
    assert head.content == b"" and get.content
    assert head.headers["content-type"] == get.headers["content-type"]
    assert int(head.headers["content-length"]) > 0


def test_retrieve_model_is_the_entry_of_the_list(http, client, assert_error):
    listed = http.get("/v1/models").json()["data"][0]
    one = http.get("/v1/models/fovea-shapes")
    assert one.status_code == 200 and one.json() == listed
    assert client.models.retrieve("fovea-shapes").id == "fovea-shapes"  # the openai client's own call
    for name in ("gpt-4o", "org/fovea-shapes"):  # another name, with a slash too
        error = assert_error(http.get(f"/v1/models/{name}"), 404, "model_not_found")
        assert name in error["message"] and "fovea-shapes" in error["message"]


def test_tokenize_messages_counts_image_tokens_as_chat_does(http, client, demo_model):
    body = http.post("/tokenize", json={"model": "fovea-shapes", "messages": MESSAGES}).json()
    reply = client.chat.completions.create(model="fovea-shapes", messages=MESSAGES, max_tokens=1)
    assert body["count"] == len(body["tokens"]) == reply.usage.prompt_tokens
    image_id = demo_model.tokenizer.convert_tokens_to_ids(demo_model.image_token)
    assert body["tokens"].count(image_id) > 16  # the image is its placeholder run, not one token
    models = http.get("/v1/models").json()["data"][0]
    assert body["max_model_len"] == models["max_model_len"] and body["token_strs"] is None


def test_tokenize_prompt_matches_completions(http, client):
    body = http.post("/tokenize", json={"prompt": PROMPT, "images": [URL], "return_token_strs": True}).json()
    reply = client.completions.create(model="fovea-shapes", prompt=PROMPT, max_tokens=1,
                                      extra_body={"images": [URL]})
    assert body["count"] == reply.usage.prompt_tokens
    assert len(body["token_strs"]) == body["count"] and all(isinstance(s, str) for s in body["token_strs"])
    text_only = http.post("/tokenize", json={"prompt": "hello there"}).json()
    assert text_only["count"] == len(text_only["tokens"]) > 0


def test_tokenize_add_special_tokens_reads_as_each_endpoint_does(http, demo_model):
    """The demo's tokenizer adds a BOS, and its chat template writes one: a prompt has it unless
    add_special_tokens is false; messages get a second one only with true."""
    bos = demo_model.tokenizer.bos_token_id
    assert bos is not None

    def tokens(**body) -> list[int]:
        reply = http.post("/tokenize", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["tokens"]

    prompt = tokens(prompt=PROMPT, images=[URL])
    assert prompt[0] == bos and prompt == tokens(prompt=PROMPT, images=[URL], add_special_tokens=True)
    assert tokens(prompt=PROMPT, images=[URL], add_special_tokens=False) == prompt[1:]
    chat = tokens(messages=MESSAGES)
    assert chat[0] == bos and chat[1] != bos and chat == tokens(messages=MESSAGES, add_special_tokens=False)
    assert tokens(messages=MESSAGES, add_special_tokens=True) == [bos, *chat]


def test_detokenize_round_trips(http):
    tokens = http.post("/tokenize", json={"prompt": "red circle and blue square"}).json()["tokens"]
    text = http.post("/detokenize", json={"model": "fovea-shapes", "tokens": tokens}).json()["prompt"]
    assert "red circle and blue square" in text


@pytest.mark.parametrize(("path", "body", "status", "code", "param"), [
    ("/tokenize", {}, 400, "invalid_request", None),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "invalid_request", None),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": False}, 400, "unsupported_parameter",
     "add_generation_prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, 400, "invalid_request", "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "model_not_found", "model"),
    ("/tokenize", {"prompt": PROMPT, "images": []}, 400, "image_placeholder_mismatch", None),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "invalid_request", "tokens[1]"),
    ("/detokenize", {"tokens": [-1]}, 400, "invalid_request", "tokens[0]"),
    ("/detokenize", {"tokens": "abc"}, 400, "invalid_request", "tokens"),
])
def test_tokenize_refusals(http, assert_error, path, body, status, code, param):
    assert_error(http.post(path, json=body), status, code, param if param else "<any>")


def test_stream_options_without_stream_is_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fovea-shapes", messages=MESSAGES,
                                       stream_options={"include_usage": True})
    assert info.value.body["param"] == "stream_options"


def test_unsupported_parameter_through_the_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fovea-shapes", messages=MESSAGES, modalities=["text", "audio"])
    assert info.value.body["code"] == "unsupported_parameter" and info.value.body["param"] == "modalities"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fovea-shapes", prompt="hello", echo=True)
    assert info.value.body["code"] == "unsupported_parameter" and info.value.body["param"] == "echo"
    ok = client.chat.completions.create(model="fovea-shapes", messages=MESSAGES, max_tokens=2, user="alice",
                                        n=1, logprobs=False, presence_penalty=0)
    assert ok.usage.completion_tokens == 2


@pytest.mark.parametrize(("extra", "param"), [({"stream": True}, "stream"), ({"fovea": {"grounding": True}}, "fovea"),
                                              ({"user": "alice"}, "user"), ({"logprobs": 2}, "logprobs"),
                                              ({"frobnicate": 1}, "frobnicate")])
def test_generate_refuses_what_it_does_not_do(http, assert_error, extra, param):
    assert_error(http.post("/generate", json={"prompt": "hello", **extra}), 400, "unsupported_parameter", param)


def test_generate_honours_its_fields(http):
    body = http.post("/generate", json={"prompt": "Describe the image.", "image": URL, "max_tokens": 2,
                                        "temperature": 0, "n": 1}).json()
    assert body["usage"]["completion_tokens"] == 2 and body["finish_reason"] == "length"
    many = http.post("/generate", json={"prompt": "Describe the image.", "image": URL, "max_tokens": 2,
                                        "temperature": 0, "n": 2}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1] and many["usage"]["completion_tokens"] == 4
    assert all(c["text"] == body["text"] for c in many["choices"]) and many["text"] == body["text"]
