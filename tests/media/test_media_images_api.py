"""/v1/images over HTTP, through a minimal app with the same FoveaError handler the server installs."""

from __future__ import annotations

import base64

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from media_helpers import encode, png, rgb

from fovea.errors import FoveaError
from fovea.media import ImageStore, MediaConfig, image_id_for
from fovea.serve.images_api import make_images_router

PNG = encode(rgb(), "PNG")


def make_client(config: MediaConfig) -> tuple[TestClient, ImageStore]:
    store = ImageStore(config)
    app = FastAPI()
    app.include_router(make_images_router(store, config))

    @app.exception_handler(FoveaError)
    async def _fovea(request: Request, exc: FoveaError) -> JSONResponse:
        return JSONResponse(exc.to_body(), status_code=exc.status)

    return TestClient(app), store


@pytest.fixture
def client() -> TestClient:
    return make_client(MediaConfig())[0]


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def expected_metadata(data: bytes = PNG) -> dict:
    return {"id": image_id_for(data), "object": "image", "width": 37, "height": 23, "bytes": len(data)}


def test_multipart_upload(client: TestClient) -> None:
    response = client.post("/v1/images", files={"file": ("cat.png", PNG, "image/png")})
    assert response.status_code == 200
    body = response.json()
    assert {k: body[k] for k in expected_metadata()} == expected_metadata()
    assert isinstance(body["created"], int)


@pytest.mark.parametrize("image", ["data:image/png;base64," + base64.b64encode(PNG).decode(),
                                   base64.b64encode(PNG).decode()])
def test_json_upload(client: TestClient, image: str) -> None:
    response = client.post("/v1/images", json={"image": image})
    assert response.status_code == 200
    assert response.json()["id"] == image_id_for(PNG)


def test_raw_body_upload(client: TestClient) -> None:
    response = client.post("/v1/images", content=PNG, headers={"Content-Type": "image/png"})
    assert response.status_code == 200 and response.json()["id"] == image_id_for(PNG)


def test_get_then_delete_then_404() -> None:
    client, store = make_client(MediaConfig())
    image_id = client.post("/v1/images", files={"file": ("cat.png", PNG)}).json()["id"]
    got = client.get(f"/v1/images/{image_id}")
    assert got.status_code == 200 and got.json()["id"] == image_id and got.json()["width"] == 37
    deleted = client.delete(f"/v1/images/{image_id}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": image_id, "object": "image", "deleted": True}
    assert len(store) == 0
    for response in (client.get(f"/v1/images/{image_id}"), client.delete(f"/v1/images/{image_id}"),
                     client.get("/v1/images/not-an-id")):
        assert response.status_code == 404 and error_of(response)["code"] == "image_not_found"


@pytest.mark.parametrize(("kwargs", "status", "code", "param"), [
    ({"files": {"file": ("x.png", b"not an image")}}, 400, "invalid_image", "file"),
    ({"files": {"file": ("x.png", PNG[:200])}}, 400, "invalid_image", "file"),
    ({"files": {"file": ("x.svg", b"<svg xmlns='http://www.w3.org/2000/svg'/>")}}, 400,
     "unsupported_image_format", "file"),
    ({"files": {"image": ("x.png", PNG)}}, 400, "invalid_request", "file"),
    ({"files": {"file": (None, "just a string")}}, 400, "invalid_request", "file"),
    ({"data": {"file": "x"}}, 400, "invalid_request", None),  # urlencoded form, not multipart
    ({"json": {"image": "data:text/plain;base64,aGVsbG8="}}, 400, "invalid_image", "image"),
    ({"json": {"image": "!!!"}}, 400, "invalid_image", "image"),
    ({"json": {"image": "https://example.com/cat.png"}}, 400, "invalid_request", "image"),
    ({"json": {"image": "file:///etc/passwd"}}, 400, "invalid_request", "image"),
    ({"json": {"image": 42}}, 400, "invalid_request", "image"),
    ({"json": {"picture": "abc"}}, 400, "invalid_request", "image"),
    ({"json": ["image"]}, 400, "invalid_request", "image"),
    ({"content": b"{not json", "headers": {"Content-Type": "application/json"}}, 400, "invalid_request",
     None),
    ({"content": b"hello", "headers": {"Content-Type": "text/plain"}}, 400, "invalid_request", None),
    ({"content": b"", "headers": {"Content-Type": "image/png"}}, 400, "invalid_image", None),
    ({"content": b"--x\r\nbroken", "headers": {"Content-Type": "multipart/form-data; boundary=x"}}, 400,
     "invalid_request", "file"),
])
def test_refusals(client: TestClient, kwargs: dict, status: int, code: str, param: str | None) -> None:
    response = client.post("/v1/images", **kwargs)
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["code"] == code and error["param"] == param
    assert len(error["message"]) > 30


def test_too_large_upload_is_413_for_every_encoding() -> None:
    config = MediaConfig(max_image_bytes=len(PNG) - 1)
    client, store = make_client(config)
    for kwargs in ({"files": {"file": ("cat.png", PNG)}},
                   {"json": {"image": base64.b64encode(PNG).decode()}},
                   {"content": PNG, "headers": {"Content-Type": "image/png"}}):
        response = client.post("/v1/images", **kwargs)
        assert response.status_code == 413 and error_of(response)["code"] == "image_too_large"
    assert len(store) == 0


def test_oversized_chunked_body_is_cut_off() -> None:
    config = MediaConfig(max_image_bytes=1000)
    client, _ = make_client(config)

    def chunks():  # no Content-Length: only counting while streaming can catch it
        for _ in range(1000):
            yield b"\x00" * 1000

    response = client.post("/v1/images", content=chunks(), headers={"Content-Type": "image/png"})
    assert response.status_code == 413 and error_of(response)["code"] == "image_too_large"


def test_pixel_bomb_upload_is_400_image_too_large(client: TestClient) -> None:
    response = client.post("/v1/images", files={"file": ("bomb.png", png(100_000, 100_000))})
    assert response.status_code == 400 and error_of(response)["code"] == "image_too_large"
