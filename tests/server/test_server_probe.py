"""What an adversarial probe of the server found, pinned: parser depth, JSON errors, the slash
redirect, the model path, idle connections, misframed requests, a client gone mid-body."""

import logging
import socket
import time

import httpx
import pytest
from framing_helpers import (
    MISFRAMED,
    PIPELINED,
    STATUS_LINE,
    address,
    assert_one_framing_refusal,
    counted,
    send_part_of_a_body,
    until_closed,
)

from fovea.serve import http_protocol
from fovea.serve.http_protocol import DeadlineH11Protocol

DEEP = "[" * 100_000 + "]" * 100_000
ROUTES = ["/v1/images", "/v1/chat/completions", "/v1/completions", "/generate"]


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("payload", [DEEP.encode(), b"{not json", b'{"prompt": "\xff\xfe"}'],
                         ids=["nested-100k", "broken", "not-utf8"])
def test_unparseable_bodies_are_invalid_request_400s(server, assert_error, route, payload):
    reply = httpx.post(server.base_url + route, content=payload, headers={"content-type": "application/json"},
                       timeout=60)
    error = assert_error(reply, 400, "invalid_request")
    assert "JSON" in error["message"]


def test_a_trailing_slash_is_served_in_place_not_redirected_to_the_clients_host(server):
    reply = httpx.get(server.base_url + "/v1/models/", headers={"Host": "evil.example"}, follow_redirects=False)
    assert reply.status_code == 200 and "location" not in reply.headers
    assert reply.json()["data"][0]["id"] == "fovea-shapes"
    assert httpx.get(server.base_url + "/health/").json()["status"] in ("ok", "degraded")


def test_models_do_not_expose_the_servers_filesystem(server):
    model = httpx.get(server.base_url + "/v1/models").json()["data"][0]
    assert model["root"] == model["id"] and "/" not in model["root"]
    assert model["max_model_len"] == server.app.state.fovea.engine.max_context


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 response (head and a Content-Length body): recv may return the head
    and the body separately, and a second request must not read the first one's body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed mid-response: {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed mid-body"
        body += chunk
    assert len(body) == length, "more bytes than the response's Content-Length"
    return head + b"\r\n\r\n" + body


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes the connection within ``seconds`` (the peer's EOF arrives)."""
    sock.settimeout(seconds)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.fixture
def quick_deadline(monkeypatch, make_server):
    monkeypatch.setattr(DeadlineH11Protocol, "head_timeout_s", 0.5)
    monkeypatch.setattr(http_protocol, "KEEP_ALIVE_S", 1)
    live = make_server()
    host, port = live.base_url.removeprefix("http://").split(":")
    return host, int(port)


def test_a_connection_that_never_sends_is_closed(quick_deadline):
    with socket.create_connection(quick_deadline) as sock:
        started = time.monotonic()
        assert closed_within(sock, 10)
        assert time.monotonic() - started >= 0.4


def test_a_client_dripping_a_request_head_is_closed(quick_deadline):
    with socket.create_connection(quick_deadline) as sock:
        started = time.monotonic()
        for byte in b"GET /health HTTP/1.1\r\n":
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            if time.monotonic() - started > 3:
                break
            time.sleep(0.05)
        assert closed_within(sock, 10)
        assert time.monotonic() - started < 3


def test_a_kept_alive_connection_serves_then_closes_when_idle(quick_deadline):
    with socket.create_connection(quick_deadline) as sock:
        for _ in range(2):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(10)
            assert read_response(sock).startswith(b"HTTP/1.1 200")
        assert closed_within(sock, 10)


def test_an_idle_pooled_connection_outlives_the_clients_pool_expiry(server):
    """httpx's pool drops idle connections after 5 s; the server keeps them longer, so a request is
    never sent on a connection the server is closing at that moment."""
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.settimeout(10)
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        assert not closed_within(sock, 6.0)  # still open after 6 s idle
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("request_bytes", MISFRAMED.values(), ids=MISFRAMED.keys())
def test_a_misframed_request_is_refused_and_its_connection_closed_before_a_pipelined_one(server, request_bytes):
    assert_one_framing_refusal(server.base_url, request_bytes)


def test_a_well_framed_request_keeps_its_connection_for_the_pipelined_one(server):
    with socket.create_connection(address(server.base_url)) as sock:
        sock.sendall(PIPELINED + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert STATUS_LINE.findall(until_closed(sock)) == [b"200", b"200"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/images",
                                   "/tokenize"])
def test_a_client_that_hangs_up_mid_body_is_one_access_line_and_counted_as_499(server, caplog, route):
    def count() -> float:
        return counted(httpx.get(server.base_url + "/metrics").text, "fovea_requests_total", route, 499)

    before = count()
    with caplog.at_level(logging.INFO):
        send_part_of_a_body(server.base_url, route)
        deadline = time.monotonic() + 10
        while count() == before and time.monotonic() < deadline:
            time.sleep(0.05)
    assert count() == before + 1
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    lines = [r.getMessage() for r in caplog.records if r.name == "fovea.access" and route in r.getMessage()]
    assert len(lines) == 1 and "499" in lines[0] and "client_disconnected" in lines[0], lines
