"""The sampling and output fields of issue 14 through the official ``openai`` client against a live
``fovea serve`` on the demo model: n, logprobs/top_logprobs, penalties, logit_bias, stop_token_ids,
top_k and min_p (vLLM's extensions go in ``extra_body``, as with vLLM), streaming included."""

from __future__ import annotations

import functools

import openai
import pytest
import transformers
from scene_helpers import data_url, fresh_scene

from fovea.demo import scenes
from fovea.loading.loader import default_model_dir

SCENE = fresh_scene(6100, min_shapes=2)
URL = data_url(scenes.render(SCENE))
ANSWER = scenes.describe_answer(SCENE)
PROMPT = "user: <image> Describe the image. assistant:"


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return live_server.client()


@functools.cache
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(default_model_dir())


def token_id(word: str) -> int:
    return tokenizer().convert_tokens_to_ids(word)


def decode(tokens: list[str]) -> str:
    return tokenizer().decode([token_id(t) for t in tokens])


def chat(client, **kw):
    return client.chat.completions.create(model="fovea-shapes", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": URL}}, {"type": "text", "text": "Describe the image."}]}], **kw)


def complete(client, **kw):
    return client.completions.create(model="fovea-shapes", prompt=PROMPT, extra_body={"images": [URL],
                                     **kw.pop("extra_body", {})}, **kw)


def test_n_choices_with_seeds_are_indexed_reproducible_and_counted_once(client):
    single = chat(client, temperature=0)
    reply = chat(client, n=3, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2] and {c.message.content for c in reply.choices} == {ANSWER}
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens
    assert reply.usage.completion_tokens == 3 * single.usage.completion_tokens
    seeded = [[c.message.content for c in chat(client, n=3, temperature=2.0, seed=4, max_tokens=8).choices]
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    assert seeded[0][1] == chat(client, temperature=2.0, seed=5, max_tokens=8).choices[0].message.content  # seed+1
    texts = [c.text for c in complete(client, n=2, temperature=0).choices]
    assert texts == [ANSWER, ANSWER]


def test_n_choices_stream_with_their_indexes(client):
    texts = {0: "", 1: "", 2: ""}
    finishes, usage = {}, None
    for chunk in chat(client, n=3, temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {0: ANSWER, 1: ANSWER, 2: ANSWER} and finishes == {0: "stop", 1: "stop", 2: "stop"}
    assert usage is not None and usage.completion_tokens == 3 * chat(client, temperature=0).usage.completion_tokens


def test_chat_logprobs_and_top_logprobs(client):
    reply = chat(client, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert decode([e.token for e in content]) == ANSWER  # the demo tokenizer's words, one a token
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
    streamed = [e for c in chat(client, temperature=0, logprobs=True, top_logprobs=3, stream=True)
                for ch in c.choices if ch.logprobs is not None for e in ch.logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    with pytest.raises(openai.BadRequestError):
        chat(client, logprobs=True, top_logprobs=21)


def test_completions_logprobs_legacy_shape_streamed_too(client):
    lp = complete(client, temperature=0, logprobs=2).choices[0].logprobs
    assert decode(lp.tokens) == ANSWER and len(lp.token_logprobs) == len(lp.tokens) == len(lp.text_offset)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(tok in top and len(top) <= 3 for tok, top in zip(lp.tokens, lp.top_logprobs))
    streamed = [t for c in complete(client, temperature=0, logprobs=2, stream=True)
                for ch in c.choices if ch.logprobs is not None for t in ch.logprobs.tokens]
    assert streamed == lp.tokens


def test_penalties_logit_bias_and_stop_token_ids(client):
    red = token_id("red")
    assert chat(client, temperature=0, max_tokens=3, logit_bias={str(red): 100}).choices[0].message.content \
        == "red red red"
    # The same forcing bias with a presence penalty: still forced (100 - 2 leads), so penalties
    # and bias combine; a huge repetition penalty changes the greedy answer.
    assert chat(client, temperature=0, max_tokens=3, logit_bias={str(red): 100}, presence_penalty=2,
                frequency_penalty=2).choices[0].message.content == "red red red"
    assert chat(client, temperature=0, extra_body={"repetition_penalty": 50.0}).choices[0].message.content != ANSWER
    stop = token_id(ANSWER.split()[2])
    reply = chat(client, temperature=0, extra_body={"stop_token_ids": [stop]})
    assert reply.choices[0].message.content == " ".join(ANSWER.split()[:2])
    assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, logit_bias={"999999": 1})
    assert caught.value.body["code"] == "invalid_request" and caught.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError):
        chat(client, presence_penalty=3)


def test_top_k_and_min_p(client):
    for seed in range(3):
        assert chat(client, temperature=2.0, seed=seed, extra_body={"top_k": 1}).choices[0].message.content == ANSWER
        assert complete(client, temperature=2.0, seed=seed, extra_body={"min_p": 1.0}).choices[0].text == ANSWER
