"""Each server set-up is what it claims: the per-sequence limit its flags leave is the one the
server enforces (so a test passing under a small --max-model-len or KV cache ran under it), and
a request that names no max_tokens is answered within it (issue 23: it used to be refused)."""

from __future__ import annotations

import re

import openai
import pytest
from scene_helpers import data_url, fresh_scene
from servers import Served
from structured_helpers import user

from fovea.demo import scenes

SCENE = fresh_scene(6200, min_shapes=2)
URL = data_url(scenes.render(SCENE))
ANSWER = scenes.describe_answer(SCENE)


def demo_chat(client: openai.OpenAI, **kw):
    content = [{"type": "image_url", "image_url": {"url": URL}}, {"type": "text", "text": "Describe the image."}]
    return client.chat.completions.create(model="fovea-shapes", temperature=0, **kw,
                                          messages=[{"role": "user", "content": content}])


def assert_refused_past(client: openai.OpenAI, limit: int, call) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    # The message names the limit: the server's (--max-model-len, KV cache) or the model's context.
    assert caught.value.code == "context_length_exceeded" and re.search(rf"(limit|context) of {limit}\b",
                                                                        caught.value.message), caught.value.message


def test_the_demo_server_holds_its_setups_limit_and_fills_an_unset_max_tokens_within_it(live_server: Served):
    client, limit = live_server.client(), live_server.setup.limit("demo")
    assert client.models.retrieve("fovea-shapes").max_model_len == limit
    reply = demo_chat(client)  # no max_tokens: the limit minus the prompt, not the model's context
    assert reply.choices[0].message.content == ANSWER and reply.choices[0].finish_reason == "stop"
    room = limit - reply.usage.prompt_tokens
    assert demo_chat(client, max_tokens=room).choices[0].message.content == ANSWER
    assert_refused_past(client, limit, lambda: demo_chat(client, max_tokens=room + 1))


def test_the_byte_server_holds_its_setups_limit_and_fills_an_unset_max_tokens_within_it(byte_server: Served):
    client, limit = byte_server.client(), byte_server.setup.limit("byte")
    (model,) = client.models.list().data
    assert model.max_model_len == limit
    # No max_tokens; the choice ends the answer (random weights would otherwise run to the limit).
    reply = client.chat.completions.create(model=model.id, messages=user("Left or right?", image=True),
                                           extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert reply.choices[0].message.content in ("left", "right") and reply.choices[0].finish_reason == "stop"
    room = limit - reply.usage.prompt_tokens
    assert_refused_past(client, limit, lambda: client.chat.completions.create(
        model=model.id, messages=user("Left or right?", image=True), max_tokens=room + 1))
