"""/v1/completions in OpenAI's four prompt shapes: a string, a list of token ids, and batches of
either; token ids are checked against the vocabulary, and a batch's choices are indexed prompt by
prompt, n each, with every prompt counted in usage (streamed or not)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

TEXTS = ["user: how many shapes are there ? assistant:", "user: what color is the circle ? assistant:"]


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=120) as client:
        yield client


def ids_of(http, text: str) -> list[int]:
    reply = http.post("/tokenize", json={"prompt": text})
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def complete(http, **body) -> dict:
    reply = http.post("/v1/completions", json={"temperature": 0, "max_tokens": 6, "ignore_eos": True, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def texts(body: dict) -> list[str]:
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    return [c["text"] for c in body["choices"]]


def test_token_ids_are_the_prompt_they_spell(http):
    ids = ids_of(http, TEXTS[0])
    by_text, by_ids = complete(http, prompt=TEXTS[0]), complete(http, prompt=ids)
    assert texts(by_ids) == texts(by_text) and by_ids["usage"] == by_text["usage"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    # A batch of one, and the logprobs of a token-id prompt's answer.
    assert texts(complete(http, prompt=[ids])) == texts(by_text)
    scored = complete(http, prompt=ids, logprobs=2)
    assert len(scored["choices"][0]["logprobs"]["token_logprobs"]) == 6


@pytest.mark.parametrize("shape", ["text", "ids"])
def test_a_batch_answers_each_prompt_n_times_in_order(http, shape):
    singles = [complete(http, prompt=text) for text in TEXTS]
    batch = TEXTS if shape == "text" else [ids_of(http, text) for text in TEXTS]
    body = complete(http, prompt=batch, n=2)
    assert texts(body) == [texts(singles[0])[0]] * 2 + [texts(singles[1])[0]] * 2
    assert body["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert body["usage"]["completion_tokens"] == 2 * sum(s["usage"]["completion_tokens"] for s in singles)


def test_a_streamed_batch_ends_every_choice_and_counts_every_prompt(http):
    singles = [complete(http, prompt=text) for text in TEXTS]
    body = {"prompt": [ids_of(http, t) for t in TEXTS], "n": 2, "temperature": 0, "max_tokens": 6,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        lines = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    pieces: dict[int, str] = {}
    finished = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        pieces[choice["index"]] = pieces.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finished[choice["index"]] = choice["finish_reason"]
    assert finished == {i: "length" for i in range(4)}
    assert [pieces[i] for i in range(4)] == [texts(singles[0])[0]] * 2 + [texts(singles[1])[0]] * 2
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": sum(s["usage"]["prompt_tokens"] for s in singles), "completion_tokens": 24,
        "total_tokens": sum(s["usage"]["prompt_tokens"] for s in singles) + 24}


def test_the_openai_client_sends_token_ids_and_batches(live_server, http):
    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    ids = ids_of(http, TEXTS[0])
    one = client.completions.create(model="fovea-shapes", prompt=ids, max_tokens=4, temperature=0)
    both = client.completions.create(model="fovea-shapes", prompt=[ids, ids_of(http, TEXTS[1])], max_tokens=4,
                                     temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and both.choices[0].text == one.choices[0].text


def refusal(http, body: dict, status: int = 400) -> dict:
    reply = http.post("/v1/completions", json={"max_tokens": 2, **body})
    assert reply.status_code == status, reply.text
    return reply.json()["error"]


def test_bad_token_prompts_are_400s_naming_the_token(http, demo_model):
    vocab = len(demo_model.tokenizer)
    image = demo_model.tokenizer.convert_tokens_to_ids(demo_model.image_token)
    error = refusal(http, {"prompt": [1, 9, vocab]})
    assert error["code"] == "invalid_request" and error["param"] == "prompt[2]"
    assert str(vocab) in error["message"] and f"0..{vocab - 1}" in error["message"]
    assert refusal(http, {"prompt": [[1, 9], [1, -1]]})["param"] == "prompt[1][1]"
    error = refusal(http, {"prompt": [1, image, 9]})
    assert error["code"] == "image_placeholder_mismatch" and error["param"] == "prompt[1]"
    for prompt in ([], [[]], [[1], []], [1, "a"], [True], [1.5]):
        assert refusal(http, {"prompt": prompt})["code"] == "invalid_request", prompt
    assert refusal(http, {"prompt": [[1]] * 129})["param"] == "prompt"


def test_what_a_batch_or_token_prompt_cannot_carry_is_refused(http):
    url = "data:image/png;base64,AAAA"
    assert refusal(http, {"prompt": TEXTS, "images": [url]})["param"] == "images"
    assert refusal(http, {"prompt": [1, 9], "images": [url]})["param"] == "images"
    assert refusal(http, {"prompt": TEXTS, "fovea": {"timing": True}})["param"] == "fovea"
    error = refusal(http, {"prompt": ["user: <image> hi", "hi"]})
    assert error["code"] == "image_placeholder_mismatch" and error["param"] == "prompt[0]"
    error = refusal(http, {"prompt": ["hi", "hi"], "max_tokens": 100_000})
    assert error["code"] == "context_length_exceeded" and error["message"].startswith("prompt[0]: ")
