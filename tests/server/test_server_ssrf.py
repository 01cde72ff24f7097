"""http(s) image URLs against a loopback HTTP server run by the test: the SSRF rules end to end.

Two fovea servers allow only the host name ``localhost``: one with the default
``allow_private_addresses=False`` (loopback must be refused before any connection), one with it on
(the fetch works, and every other rule - redirects, size cap, deadline - still holds).
"""

from __future__ import annotations

import base64
import http.server as http_server
import io
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from scene_helpers import QuietHandler, fresh_scene

from fovea.demo import scenes
from fovea.media import MediaConfig

MAX_IMAGE_BYTES = 64 * 1024
# Generous: with 0.5 s, a CI run on a 2-core machine once answered 400 to a loopback fetch of a
# 600-byte PNG (the body went unrecorded; a missed deadline is the likely cause). The slow-server
# tests still tell a deadline from no deadline.
TIMEOUT_S = 2.0
SCENE = fresh_scene(8100, min_shapes=2, jpeg_probability=0.0)


def png(scene) -> bytes:
    buffer = io.BytesIO()
    scenes.render(scene).save(buffer, format="PNG")
    return buffer.getvalue()


class Origin:
    """The loopback image host: records every request path and Host header it receives."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.png = png(SCENE)
        self.httpd = http_server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]

    def url(self, path: str, host: str = "localhost") -> str:
        return f"http://{host}:{self.port}{path}"

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    def _handler(self):
        origin = self

        class Handler(QuietHandler):

            def do_GET(self) -> None:
                origin.requests.append((self.path, self.headers.get("Host", "")))
                path = self.path
                if path == "/scene.png":
                    self.send(200, origin.png, {"Content-Type": "image/png"})
                elif path == "/redirect-same-host":
                    self.send(302, headers={"Location": "/scene.png"})
                elif path == "/redirect-other-host":
                    self.send(302, headers={"Location": "http://images.example.com/scene.png"})
                elif path == "/redirect-by-ip":  # same server, but 127.0.0.1 is not an allowed name
                    self.send(302, headers={"Location": origin.url("/scene.png", host="127.0.0.1")})
                elif path == "/redirect-metadata":
                    self.send(307, headers={"Location": "http://169.254.169.254/latest/meta-data/"})
                elif path == "/redirect-file":
                    self.send(302, headers={"Location": "file:///etc/passwd"})
                elif path == "/redirect-loop":
                    self.send(302, headers={"Location": "/redirect-loop"})
                elif path == "/big-declared":
                    self.send(200, b"\x89PNG\r\n\x1a\n", {"Content-Length": str(MAX_IMAGE_BYTES + 1)})
                elif path == "/big-streamed":  # no Content-Length: only counting while reading catches it
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.close_connection = True
                    self.wfile.write(origin.png)
                    for _ in range(2 * MAX_IMAGE_BYTES // 4096):
                        self.wfile.write(b"\x00" * 4096)
                elif path == "/slow-headers":
                    time.sleep(3 * TIMEOUT_S)
                    self.send(200, origin.png, {"Content-Type": "image/png"})
                elif path == "/slow-drip":  # each byte arrives before a read timeout, the whole never does
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(origin.png)))
                    self.end_headers()
                    for i in range(0, len(origin.png), 64):
                        self.wfile.write(origin.png[i:i + 64])
                        self.wfile.flush()
                        time.sleep(TIMEOUT_S / 5)
                        if i > 64 * 40:
                            break
                elif path == "/html":
                    self.send(200, b"<!DOCTYPE html><html><body>sign in</body></html>", {"Content-Type": "text/html"})
                else:
                    self.send(404, b"not found")

        return Handler


@pytest.fixture(scope="module")
def origin() -> Iterator[Origin]:
    server = Origin()
    thread = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()


def media(allow_private: bool) -> MediaConfig:
    return MediaConfig(allowed_media_domains=("localhost",), allow_private_addresses=allow_private,
                       fetch_timeout_s=TIMEOUT_S, max_image_bytes=MAX_IMAGE_BYTES,
                       store_max_bytes=4 * MAX_IMAGE_BYTES)


@pytest.fixture(scope="module")
def strict(make_server):
    return make_server(media=media(allow_private=False))


@pytest.fixture(scope="module")
def loose(make_server):
    return make_server(media=media(allow_private=True))


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30, trust_env=False) as client:
        yield client


def ask(http: httpx.Client, server, url: str, question: str = "Describe the image.") -> httpx.Response:
    return http.post(server.base_url + "/v1/chat/completions", json={"model": "fovea-shapes", "messages": [
        {"role": "user", "content": [{"type": "text", "text": question},
                                     {"type": "image_url", "image_url": {"url": url}}]}]})


@pytest.fixture(scope="module")
def inline_answer(http, loose, origin) -> str:
    response = ask(http, loose, "data:image/png;base64," + base64.b64encode(origin.png).decode())
    assert response.status_code == 200
    answer = response.json()["choices"][0]["message"]["content"]
    assert answer == scenes.describe_answer(SCENE)
    return answer


# ---- private addresses refused by default ----------------------------------------------------------

@pytest.mark.parametrize("path", ["/scene.png", "/redirect-same-host", "/slow-headers"])
def test_loopback_refused_by_default_without_contacting_it(path, http, strict, origin, assert_error):
    before = len(origin.requests)
    response = ask(http, strict, origin.url(path))
    error = assert_error(response, 403, "media_source_forbidden", "messages[0].content[1]")
    assert "127.0.0.1" in error["message"] and "loopback" in error["message"]
    assert len(origin.requests) == before, "the refused host was contacted"


def test_loopback_refused_by_default_on_every_endpoint(http, strict, origin, assert_error):
    url = origin.url("/scene.png")
    before = len(origin.requests)
    completions = http.post(strict.base_url + "/v1/completions",
                            json={"prompt": "user: <image> Describe the image. assistant:", "images": [url]})
    assert_error(completions, 403, "media_source_forbidden", "images[0]")
    generate = http.post(strict.base_url + "/generate", json={"prompt": "Describe the image.", "image": url})
    assert_error(generate, 403, "media_source_forbidden", "image")
    assert len(origin.requests) == before, "the refused host was contacted"


# ---- allowed when private addresses are allowed ----------------------------------------------------

def test_allowed_and_answered_when_private_addresses_are_allowed(http, loose, origin, inline_answer):
    before = len(origin.requests)
    response = ask(http, loose, origin.url("/scene.png"))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == inline_answer
    # Fetched once, by name: the Host header carries the allowed name, not the pinned address.
    assert origin.requests[before:] == [("/scene.png", f"localhost:{origin.port}")]
    generate = http.post(loose.base_url + "/generate",
                         json={"prompt": "How many shapes are there?", "image": origin.url("/scene.png")})
    assert generate.status_code == 200, generate.text
    assert generate.json()["text"] == scenes.count(SCENE).answer


def test_redirect_within_the_allowed_host_is_followed(http, loose, origin, inline_answer):
    before = len(origin.requests)
    response = ask(http, loose, origin.url("/redirect-same-host"))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == inline_answer
    assert origin.paths()[before:] == ["/redirect-same-host", "/scene.png"]


@pytest.mark.parametrize("path", ["/redirect-other-host", "/redirect-by-ip", "/redirect-metadata",
                                  "/redirect-file"])
def test_redirect_to_a_host_that_is_not_allowed_is_refused(path, http, loose, origin, assert_error):
    before = len(origin.requests)
    response = ask(http, loose, origin.url(path))
    error = assert_error(response, 400, "media_fetch_failed", "messages[0].content[1]")
    assert "redirect" in error["message"]
    assert origin.paths()[before:] == [path], "the redirect target was fetched"


def test_redirect_loop_is_cut_off(http, loose, origin, assert_error):
    before = len(origin.requests)
    assert_error(ask(http, loose, origin.url("/redirect-loop")), 400, "media_fetch_failed", "messages[0].content[1]")
    assert 1 < len(origin.requests) - before <= 5


@pytest.mark.parametrize("path", ["/big-declared", "/big-streamed"])
def test_response_bigger_than_max_image_bytes_is_refused(path, http, loose, origin, assert_error):
    error = assert_error(ask(http, loose, origin.url(path)), 400, "media_fetch_failed", "messages[0].content[1]")
    assert f"{MAX_IMAGE_BYTES:,}" in error["message"]


@pytest.mark.parametrize("path", ["/slow-headers", "/slow-drip"])
def test_slow_server_times_out(path, http, loose, origin, assert_error):
    started = time.monotonic()
    error = assert_error(ask(http, loose, origin.url(path)), 400, "media_fetch_failed", "messages[0].content[1]")
    elapsed = time.monotonic() - started
    assert "took longer" in error["message"]
    # Without the deadline, /slow-headers answers after 3x the timeout and /slow-drip runs longer still.
    assert TIMEOUT_S * 0.8 <= elapsed < TIMEOUT_S * 2.5, elapsed


@pytest.mark.parametrize("path,status,code", [("/missing", 400, "media_fetch_failed"),
                                              ("/html", 400, "invalid_image")])
def test_non_image_answers_are_refused(path, status, code, http, loose, origin, assert_error):
    assert_error(ask(http, loose, origin.url(path)), status, code, "messages[0].content[1]")


def test_servers_are_healthy_afterwards(http, strict, loose, origin, inline_answer):
    for server in (strict, loose):
        assert http.get(server.base_url + "/health").json()["status"] == "ok"
    response = ask(http, loose, origin.url("/scene.png"))
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == inline_answer
