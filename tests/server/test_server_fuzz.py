"""Hypothesis fuzzing of the request schema and of image bytes: never a 5xx, always the error shape.

Runs against a ``TestClient`` of the real app (no sockets: fast) that shares the demo model.
The inputs it found that once caused 500s (seeds outside 64 bits, tiny temperature/top_p,
'<image>' typed as text) are pinned in ``test_server_corpus.py::test_client_input_never_causes_a_5xx``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import string

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from PIL import Image
from scene_helpers import fresh_scene

from fovea.config import ServerSettings
from fovea.demo import scenes
from fovea.media import MediaConfig
from fovea.serve.app import create_app

EXAMPLES = int(os.environ.get("FOVEA_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])

IMAGE_CODES = {"invalid_image", "unsupported_image_format", "image_too_large", "media_source_forbidden",
               "media_fetch_failed", "image_not_found", "too_many_images", "image_placeholder_mismatch",
               "invalid_request", "request_too_large"}


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buffer = io.BytesIO()
    im.save(buffer, format=fmt, **kw)
    return buffer.getvalue()


SCENE = fresh_scene(91, min_shapes=2)
SMALL = scenes.render(SCENE).resize((64, 48))
VALID = [encode(SMALL, "PNG"), encode(SMALL, "JPEG", quality=80), encode(SMALL.convert("P"), "GIF"),
         encode(SMALL, "WEBP", quality=80), encode(SMALL, "BMP"), encode(SMALL, "TIFF"),
         encode(SMALL.convert("RGBA"), "PNG"), encode(SMALL.convert("L"), "JPEG"),
         encode(SMALL, "WEBP", lossless=True)]
GOOD_URL = "data:image/png;base64," + base64.b64encode(encode(scenes.render(SCENE), "PNG")).decode()


@pytest.fixture(scope="module")
def client(demo_model):
    server = ServerSettings(host="127.0.0.1", port=1, device="cpu", dtype="float32", canary=False,
                            limit_images_per_prompt=2, max_body_bytes=1024 * 1024,
                            media=MediaConfig(max_image_bytes=256 * 1024, max_image_pixels=1_000_000))
    with TestClient(create_app(server, loaded=demo_model), raise_server_exceptions=False) as test_client:
        yield test_client


def check(response, *, codes: set[str] | None = None) -> None:
    event(f"status {response.status_code}")
    assert response.status_code < 500, (response.status_code, response.text[:800])
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]")
            assert '"error"' not in response.text, response.text[-800:]
        return
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["code"], str) and error["code"], error
    assert isinstance(error["message"], str) and error["message"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    if codes is not None:
        assert error["code"] in codes, error


def post_json(client: TestClient, path: str, body) -> object:
    # json.dumps writes NaN/Infinity for non-finite floats, which Python's JSON parser accepts.
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


# ---- (a) the chat request schema -----------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


def field(valid, invalid=None, weight: int = 8):
    """Mostly a valid value (so requests get past validation often), else a wrong one or any JSON."""
    invalid = json_values if invalid is None else invalid
    return st.sampled_from([valid] * weight + [invalid, json_values]).flatmap(lambda choice: choice)


B64 = string.ascii_letters + string.digits + "+/=-_"
bad_refs = st.one_of(
    st.sampled_from(["img-" + "0" * 32, "img-xyz", "file:///etc/passwd", "file:///tmp",
                     "http://169.254.169.254/latest/meta-data/", "https://example.com/cat.png", "ftp://x/y",
                     "", "   ", "data:,", "data:image/png;base64,", "data:image/png;base64", "/etc/passwd",
                     "C:\\x.png", "~/x.png", "data:text/html;base64,PGh0bWw+"]),
    st.text(max_size=30),
    st.text(alphabet=B64, max_size=60),
    st.binary(max_size=64).map(lambda b: "data:image/png;base64," + base64.b64encode(b).decode()),
)
refs = field(st.just(GOOD_URL), bad_refs, weight=2)
image_part = st.fixed_dictionaries(
    {"type": st.just("image_url"),
     "image_url": field(st.fixed_dictionaries({"url": refs}, optional={
         "detail": field(st.sampled_from(["auto", "low", "high"]), st.just("ultra"))}))})
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": field(st.text(max_size=30))})
odd_part = st.dictionaries(st.sampled_from(["type", "text", "image_url", "image", "video"]),
                           st.sampled_from(["text", "image_url", "image", "input_audio"]) | json_values,
                           max_size=3)
part = st.one_of(image_part, text_part, text_part, text_part, odd_part)
content = field(st.text(max_size=30) | st.lists(part, min_size=1, max_size=3))
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "user", "assistant", "system", "developer"]), st.just("tool")),
     "content": content},
    optional={"name": field(st.text(max_size=5))})
messages = field(st.lists(message, min_size=1, max_size=3), st.just([]))
optional_fields = {
    "model": field(st.sampled_from(["fovea-shapes", ""]), st.just("gpt-4o")),
    "max_tokens": field(st.integers(1, 6), st.integers(-2, 0) | st.integers(500, 2**40)),
    "max_completion_tokens": field(st.integers(1, 6), st.integers(-1, 0)),
    "temperature": field(st.floats(0, 2) | st.sampled_from([0, 1]),
                         st.sampled_from([-1, 2.5, float("nan"), float("inf")])),
    "top_p": field(st.floats(0, 1, exclude_min=True), st.sampled_from([0, 1.5, -0.0])),
    "seed": field(st.integers(-2**63, 2**64 - 1), st.integers(-2**70, 2**70)),
    "stop": field(st.lists(st.text(min_size=1, max_size=4), max_size=4) | st.text(min_size=1, max_size=4),
                  st.lists(st.text(max_size=4), min_size=5, max_size=6) | st.just("")),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
    "n": field(st.just(1), st.sampled_from([0, 2])),
    "fovea": field(st.fixed_dictionaries({}, optional={"grounding": field(st.booleans())}),
                   st.just({"other": 1})),
    "user": json_values,
}
chat_bodies = field(st.fixed_dictionaries({"messages": messages}, optional=optional_fields))


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat_request_schema(client, body):
    if isinstance(body, dict) and "max_tokens" not in body and "max_completion_tokens" not in body:
        body = {**body, "max_tokens": 8}  # keep valid requests short; the schema is what is fuzzed
    check(post_json(client, "/v1/chat/completions", body))


completion_bodies = field(st.fixed_dictionaries(
    {"prompt": field(st.text(max_size=30) | st.sampled_from(["user: <image> Describe the image. assistant:",
                                                             "<image> <image> hi"]),
                     st.lists(st.text(max_size=10), max_size=2) | st.just(""))},
    optional={"images": field(st.lists(refs, max_size=3)), **optional_fields}))
generate_bodies = field(st.fixed_dictionaries(
    {"prompt": field(st.text(min_size=1, max_size=30), st.just(""))},
    optional={"image": field(refs), **optional_fields}))


@FUZZ
@given(path=st.sampled_from(["/v1/completions", "/generate"]), data=st.data())
def test_fuzz_completions_and_generate_schema(client, path, data):
    body = data.draw(completion_bodies if path == "/v1/completions" else generate_bodies)
    if isinstance(body, dict):
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body = {**body, "max_tokens": 8}
    check(post_json(client, path, body))


# ---- (b) random bytes as images ------------------------------------------------------------------

@st.composite
def image_bytes(draw) -> bytes:
    kind = draw(st.sampled_from(["random", "truncate", "overwrite", "insert", "splice", "valid"]))
    if kind == "random":
        return draw(st.binary(max_size=2048))
    data = bytearray(draw(st.sampled_from(VALID)))
    if kind == "truncate":
        return bytes(data[: draw(st.integers(0, len(data)))])
    if kind == "overwrite":
        for _ in range(draw(st.integers(1, 12))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if kind == "insert":
        at = draw(st.integers(0, len(data)))
        return bytes(data[:at]) + draw(st.binary(min_size=1, max_size=64)) + bytes(data[at:])
    if kind == "splice":  # one format's header on another's body
        other = draw(st.sampled_from(VALID))
        cut = draw(st.integers(0, 64))
        return bytes(other[:cut]) + bytes(data[cut:])
    return bytes(data)


@FUZZ
@given(data=image_bytes(), mime=st.sampled_from(["image/png", "image/jpeg", "application/octet-stream", ""]),
       question=st.sampled_from(["How many shapes are there?", "Describe the image."]))
def test_fuzz_image_bytes_as_data_urls(client, data, mime, question):
    url = f"data:{mime};base64," + base64.b64encode(data).decode()
    body = {"model": "fovea-shapes", "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]}]}
    response = post_json(client, "/v1/chat/completions", body)
    check(response, codes=IMAGE_CODES)
    if response.status_code == 200:
        assert isinstance(response.json()["choices"][0]["message"]["content"], str)
    else:
        assert response.json()["error"]["param"] == "messages[0].content[0]", response.json()
    upload = client.post("/v1/images", content=data, headers={"content-type": "application/octet-stream"})
    check(upload, codes=IMAGE_CODES)
    # Uploading and inline sending agree on what is an image.
    assert (upload.status_code == 200) == (response.status_code == 200), (upload.text, response.text)


def test_server_is_healthy_after_fuzzing(client):
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": GOOD_URL}}, {"type": "text", "text": "Describe the image."}]}]}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == scenes.describe_answer(SCENE)
    rng = random.Random(3)
    assert client.post("/v1/images", content=rng.randbytes(100),
                       headers={"content-type": "image/png"}).status_code == 400
