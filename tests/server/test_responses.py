"""/v1/responses beyond its fields: images by upload id, refusals with chat's codes, the store's
bounds, and a failure after the stream began."""

from __future__ import annotations

import json

import httpx
import pytest
from scene_helpers import data_url, fresh_scene, one_image_row_short

from fovea.demo import scenes
from fovea.serve.responses.store import ResponseNotFound, ResponseStore, TooLargeToStore

SCENE = fresh_scene(5200, min_shapes=2)
URL = data_url(scenes.render(SCENE))


def image_input(image: dict, question: str = "Describe the image.", role: str = "user") -> list:
    return [{"role": role, "content": [{"type": "input_image", **image}, {"type": "input_text", "text": question}]}]


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=120) as client:
        yield client


def answer(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text[:500]
    return reply.json()["output"][0]["content"][0]["text"]


def test_an_uploaded_image_is_read_by_file_id(http):
    upload = http.post("/v1/images", json={"image": URL})
    assert upload.status_code == 200, upload.text
    by_id = answer(http.post("/v1/responses", json={"input": image_input({"file_id": upload.json()["id"]}),
                                                    "temperature": 0}))
    assert by_id == answer(http.post("/v1/responses", json={"input": image_input({"image_url": URL}),
                                                            "temperature": 0}))
    assert by_id == scenes.describe_answer(SCENE)


@pytest.mark.parametrize(("image", "status", "code", "param"), [
    ({"image_url": "data:image/png;base64,bm90IGFuIGltYWdl"}, 400, "invalid_image", "input[0].content[0]"),
    ({"image_url": "file:///etc/passwd"}, 403, "media_source_forbidden", "input[0].content[0]"),
    ({"file_id": "file-abc"}, 404, "image_not_found", "input[0].content[0].file_id"),
    ({"file_id": "img-" + "0" * 32}, 404, "image_not_found", "input[0].content[0]"),
    ({}, 400, "invalid_request", "input[0].content[0]"),
    ({"image_url": URL, "file_id": "img-x"}, 400, "invalid_request", "input[0].content[0]"),
])
def test_bad_images_are_refused_with_chats_codes(http, assert_error, image, status, code, param):
    assert_error(http.post("/v1/responses", json={"input": image_input(image)}), status, code, param)
    assert answer(http.post("/v1/responses", json={"input": "How many shapes are there?"}))  # unharmed


def test_misplaced_images_and_placeholders_are_refused(http, assert_error):
    assert_error(http.post("/v1/responses", json={"input": image_input({"image_url": URL}, role="assistant")}),
                 400, "invalid_request", "input[0].content[0]")
    assert_error(http.post("/v1/responses", json={"input": "what is <image> here?"}),
                 400, "image_placeholder_mismatch", "input")
    too_many = [{"type": "input_image", "image_url": URL}] * 9
    assert_error(http.post("/v1/responses", json={"input": [{"role": "user", "content": too_many}]}),
                 400, "too_many_images")
    assert_error(http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 100_000}),
                 400, "context_length_exceeded", "max_output_tokens")


def test_get_and_delete(http, assert_error):
    stored = http.post("/v1/responses", json={"input": "How many shapes are there?", "store": True}).json()
    rid = stored["id"]
    assert_error(http.get(f"/v1/responses/{rid}", params={"stream": "true"}), 400, "unsupported_parameter", "stream")
    assert http.delete(f"/v1/responses/{rid}").json() == {"id": rid, "object": "response", "deleted": True}
    assert_error(http.get(f"/v1/responses/{rid}"), 404, "response_not_found")
    assert_error(http.delete(f"/v1/responses/{rid}"), 404, "response_not_found")
    assert_error(http.post("/v1/responses", json={"input": "hi", "previous_response_id": rid}), 404,
                 "response_not_found", "previous_response_id")


def turns(text: str) -> list:
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


def test_the_store_evicts_the_least_recently_used_and_refuses_what_never_fits():
    store = ResponseStore(max_entries=3, max_bytes=1000)
    for i in range(3):
        store.put(f"r{i}", {"id": f"r{i}"}, turns("x" * 10))
    store.get("r0")  # a use: r1 is now the least recently used
    store.put("r3", {"id": "r3"}, turns("x" * 10))
    assert len(store) == 3 and store.evicted == 1
    with pytest.raises(ResponseNotFound):
        store.get("r1")
    store.put("big", {"id": "big"}, turns("x" * 980))  # over the bytes: the oldest go until it fits
    assert len(store) == 1 and store.get("big").body == {"id": "big"}
    with pytest.raises(TooLargeToStore):
        store.check_fits(turns("x" * 1000))


def test_a_failure_after_the_stream_began_ends_it_with_error_and_failed(make_server):
    live = make_server()
    restore = one_image_row_short(live)  # the engine's placeholder guard fails the request once it runs
    try:
        reply = httpx.post(live.base_url + "/v1/responses", json={"input": image_input({"image_url": URL}),
                                                                  "stream": True, "store": True}, timeout=60)
    finally:
        restore()
    assert reply.status_code == 200
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
    assert "response.completed" not in kinds and events[-2]["code"] == "image_placeholder_mismatch"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "image_placeholder_mismatch"
    assert httpx.get(f"{live.base_url}/v1/responses/{failed['id']}").status_code == 404  # nothing stored
