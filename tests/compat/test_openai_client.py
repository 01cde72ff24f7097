"""The official ``openai`` client against a live fovea server, as a user would drive it: every call
goes through the client's own request building, parsing and exception mapping."""

from __future__ import annotations

import httpx
import openai
import pytest
from scene_helpers import data_url, fresh_scene
from servers import Served

from fovea import __version__
from fovea.demo import scenes

SCENE = fresh_scene(6100, min_shapes=2)
URL = data_url(scenes.render(SCENE))
ANSWER = scenes.describe_answer(SCENE)
MODEL = "fovea-shapes"


@pytest.fixture(scope="module")
def client(live_server: Served) -> openai.OpenAI:
    return live_server.client()


def chat_content(question: str = "Describe the image.") -> list:
    return [{"type": "image_url", "image_url": {"url": URL}}, {"type": "text", "text": question}]


def response_input(question: str = "Describe the image.") -> list:
    return [{"role": "user", "content": [{"type": "input_image", "image_url": URL, "detail": "auto"},
                                         {"type": "input_text", "text": question}]}]


def test_models_list(client):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.object == "model"


def test_chat_with_an_image_and_its_stream_with_usage(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": chat_content()}],
                                           temperature=0)
    assert reply.choices[0].message.content == ANSWER and reply.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": chat_content()}],
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens


def test_completions_and_their_stream(client):
    prompt = "user: <image> Describe the image. assistant:"
    reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body={"images": [URL]})
    assert reply.choices[0].text == ANSWER and reply.usage.completion_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"images": [URL]}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ANSWER
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


@pytest.mark.parametrize(("call", "exc", "status", "code"), [
    (lambda c: c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}]),
     openai.NotFoundError, 404, "model_not_found"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         extra_body={"frobnicate": 1}),
     openai.BadRequestError, 400, "unsupported_parameter"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}]),
     openai.BadRequestError, 400, "invalid_image"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]),
     openai.PermissionDeniedError, 403, "media_source_forbidden"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=3),
     openai.BadRequestError, 400, "invalid_request"),
    (lambda c: c.responses.create(model=MODEL, input="hi", reasoning={"effort": "high"}),
     openai.BadRequestError, 400, "unsupported_parameter"),
    (lambda c: c.responses.retrieve("resp_nothere"), openai.NotFoundError, 404, "response_not_found"),
])
def test_errors_arrive_as_the_clients_exception_classes_with_foveas_code(client, call, exc, status, code):
    with pytest.raises(exc) as caught:
        call(client)
    assert caught.value.status_code == status and caught.value.code == code
    assert isinstance(caught.value.message, str) and caught.value.message


def test_the_key_is_required_exactly_when_the_server_has_one(live_server):
    bare = httpx.get(live_server.base_url + "/v1/models", timeout=30)
    if live_server.setup.api_key is None:
        assert bare.status_code == 200  # no --api-key: a request without one is served
        return
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
    assert live_server.client().models.list().data[0].id == MODEL


def test_responses_create_retrieve_continue_delete(client):
    first = client.responses.create(model=MODEL, input=response_input(), temperature=0, store=True)
    assert first.output_text == ANSWER and first.status == "completed" and first.usage.input_tokens > 64
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == ANSWER
    follow = client.responses.create(model=MODEL, input="How many shapes are there?", previous_response_id=first.id,
                                     temperature=0)
    assert follow.previous_response_id == first.id and follow.usage.input_tokens > first.usage.input_tokens
    assert client.responses.delete(first.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_responses_stream_through_the_clients_helpers(client):
    with client.responses.stream(model=MODEL, input=response_input(), temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == ANSWER == final.output_text and len(deltas) > 3
    events = list(client.responses.create(model=MODEL, input=response_input(), temperature=0, stream=True,
                                          max_output_tokens=3))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 3


def test_tokenize_detokenize_and_version_through_the_client(client, live_server):
    root = live_server.base_url
    count = client.post(root + "/tokenize", cast_to=object, body={"messages": [
        {"role": "user", "content": chat_content()}]})["count"]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": chat_content()}],
                                           max_tokens=1)
    assert count == reply.usage.prompt_tokens
    tokens = client.post(root + "/tokenize", cast_to=object, body={"prompt": "a red circle"})["tokens"]
    assert client.post(root + "/detokenize", cast_to=object, body={"tokens": tokens})["prompt"].endswith("a red circle")
    assert client.get(root + "/version", cast_to=object) == {"version": __version__}
