"""Structured outputs through the official openai client against a live ``fovea serve``.

On a random-weight model with a byte-level tokenizer (the grammar makes every answer valid
whatever the weights), every answer is checked with ``jsonschema`` (or a regex / the choices);
on the demo model, whose word-level vocabulary cannot spell JSON, a JSON request is refused.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from structured_helpers import PERSON, SCHEMAS, SHAPE, schema_format, user


@pytest.fixture(scope="module")
def client(byte_server) -> openai.OpenAI:
    return byte_server.client()


@pytest.fixture(scope="module")
def aclient(byte_server) -> openai.AsyncOpenAI:
    return byte_server.aclient()


def valid(text: str, schema: dict) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def chat(client, messages, **kw):
    return client.chat.completions.create(model=_model(client), messages=messages,
                                          max_tokens=kw.pop("max_tokens", 120), **kw)


def _model(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("image", [False, True], ids=["text", "image"])
def test_json_schema_answers_validate(client, image):
    for seed in range(3):  # sampled answers differ and each one validates
        reply = chat(client, user("Describe the image.", image=image), response_format=schema_format("shape"),
                     temperature=1.0, seed=seed)
        assert reply.choices[0].finish_reason == "stop"
        valid(reply.choices[0].message.content, SHAPE)


def test_json_schema_streams(client):
    stream = chat(client, user("Who?", image=True), response_format=schema_format("person"), stream=True,
                  stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "stop" and len(pieces) > 3 and usage.completion_tokens > 3
    valid("".join(pieces), PERSON)


def test_vllm_fields_on_chat_and_completions(client):
    model = _model(client)
    answers = {
        "regex": chat(client, user("x"), extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}),
        "choice": chat(client, user("x"), extra_body={"guided_choice": ["left side", "right (or not)"]}),
        "json": chat(client, user("x"), extra_body={"structured_outputs": {"json": PERSON}}),
    }
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", answers["regex"].choices[0].message.content)
    assert answers["choice"].choices[0].message.content in ("left side", "right (or not)")
    valid(answers["json"].choices[0].message.content, PERSON)
    text = client.completions.create(model=model, prompt="hello", max_tokens=120,
                                     extra_body={"guided_json": json.dumps(SHAPE)}).choices[0]
    assert text.finish_reason == "stop"
    valid(text.text, SHAPE)
    regex = client.completions.create(model=model, prompt="hello", max_tokens=60,
                                      extra_body={"guided_regex": "(ab|cd){2}"}).choices[0].text
    assert re.fullmatch("(ab|cd){2}", regex)
    grammar = chat(client, user("x"), extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert grammar.choices[0].message.content in ("yes", "no")


def test_json_object_is_an_object(client):
    reply = chat(client, user("x"), response_format={"type": "json_object"}, max_tokens=40).choices[0]
    # Random weights write keys of any length: an answer cut by max_tokens is still an object's start.
    assert reply.message.content.startswith("{")
    if reply.finish_reason == "stop":
        assert isinstance(json.loads(reply.message.content), dict)


def test_concurrent_batch_mixes_schemas_and_free_text(aclient, client):
    """Structured rows share batches with free-text rows, which answer exactly as alone."""
    free = [user(f"Tell me {w}.") for w in ("one", "two", "three")]
    alone = [chat(client, m, temperature=0, max_tokens=24).choices[0].message.content for m in free]

    async def run():
        model = (await aclient.models.list()).data[0].id
        jobs = [aclient.chat.completions.create(model=model, messages=m, temperature=0, max_tokens=24) for m in free]
        jobs += [aclient.chat.completions.create(model=model, messages=user(f"{name} {i}", image=i % 2 == 0),
                                                 response_format=schema_format(name), max_tokens=120,
                                                 temperature=1.0, seed=i)
                 for i, name in enumerate(list(SCHEMAS) * 2)]
        return await asyncio.gather(*jobs)

    replies = asyncio.run(run())
    assert [r.choices[0].message.content for r in replies[:3]] == alone
    for reply, name in zip(replies[3:], list(SCHEMAS) * 2):
        assert reply.choices[0].finish_reason == "stop"
        valid(reply.choices[0].message.content, SCHEMAS[name])


@pytest.mark.parametrize(("extra", "code", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "invalid_json_schema", "response_format.json_schema.schema"),
    ({"extra_body": {"structured_outputs": {"regex": "([a-z"}}}, "invalid_regex", "structured_outputs.regex"),
    ({"extra_body": {"guided_grammar": "root ::= ("}}, "invalid_grammar", "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
     "conflicting_structured_outputs", "guided_choice"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}},
     "conflicting_structured_outputs", "ignore_eos"),
    ({"extra_body": {"structured_outputs": {"structural_tag": {}}}}, "unsupported_parameter", "structured_outputs"),
])
def test_refusals_name_the_problem(client, extra, code, param):
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, user("x"), **extra)
    error = caught.value.body
    assert error["code"] == code and error["param"] == param, error


def test_demo_model_cannot_spell_json(live_server):
    demo = live_server.client()
    with pytest.raises(openai.BadRequestError) as caught:
        demo.chat.completions.create(model="fovea-shapes", messages=user("Describe the image.", image=True),
                                     response_format=schema_format("shape"))
    assert caught.value.body["code"] == "grammar_unsatisfiable"
    reply = demo.chat.completions.create(model="fovea-shapes", messages=user("Is there a circle?", image=True),
                                         extra_body={"guided_choice": ["yes", "no"]})
    assert reply.choices[0].message.content in ("yes", "no") and reply.choices[0].finish_reason == "stop"


def test_every_choice_of_n_validates(client):
    """Each choice has its own matcher over the one compiled grammar."""
    reply = chat(client, user("Who?", image=True), response_format=schema_format("person"), n=3, temperature=1.0,
                 seed=5)
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        valid(choice.message.content, PERSON)
    assert len({c.message.content for c in reply.choices}) > 1  # sampled apart, each valid


def test_responses_text_format_json_schema_answers_validate(client):
    """The Responses API's text.format goes through the same grammars (with an image, streamed too)."""
    from structured_helpers import image_url

    content = [{"type": "input_image", "image_url": image_url()}, {"type": "input_text", "text": "Describe it."}]
    fmt = {"format": {"type": "json_schema", "name": "shape", "schema": SHAPE, "strict": True}}
    for seed_temperature in (0.0, 1.0):
        response = client.responses.create(model=_model(client), input=[{"role": "user", "content": content}],
                                           text=fmt, max_output_tokens=120, temperature=seed_temperature)
        assert response.status == "completed", response
        valid(response.output_text, SHAPE)
        assert response.text.format.type == "json_schema"
    with client.responses.stream(model=_model(client), input="Who?", max_output_tokens=120,
                                 text={"format": {"type": "json_object"}}) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text
    assert isinstance(json.loads(final.output_text), dict)
