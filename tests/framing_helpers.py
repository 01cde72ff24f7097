"""Raw-socket checks of HTTP/1.1 framing, shared by the aggregated server's and the front's tests."""

from __future__ import annotations

import json
import re
import socket

PIPELINED = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) [^\r\n]*\r\n")
MISFRAMED = {
    "content-length-and-chunked": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "chunked-and-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                                  b"Content-Length: 5\r\n\r\n0\r\n\r\n",
    "invalid-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5x\r\n\r\nabcde",
    "two-content-lengths": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n"
                           b"\r\nab",
    "bad-chunk-size": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n"
                      b"0\r\n\r\n",
}


def address(base_url: str) -> tuple[str, int]:
    host, port = base_url.removeprefix("http://").split(":")
    return host, int(port)


def until_closed(sock: socket.socket, seconds: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (fails if it does not)."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        raise AssertionError(f"the connection was still open after {seconds} s; got {data[:300]!r}") from None
    except ConnectionResetError:
        pass
    return data


def assert_one_framing_refusal(base_url: str, request: bytes) -> None:
    """The misframed request and a pipelined GET in one write: one JSON 400 that closes the
    connection, and the GET is never answered (RFC 9112 §6.3)."""
    with socket.create_connection(address(base_url)) as sock:
        sock.sendall(request + PIPELINED)
        data = until_closed(sock)
    assert STATUS_LINE.findall(data) == [b"400"], data[:500]
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "invalid_http_framing"


def send_part_of_a_body(base_url: str, path: str) -> None:
    """A request that declares 1,000 bytes of body, sends 13 of them, and hangs up."""
    with socket.create_connection(address(base_url)) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: 1000\r\n\r\n".encode() + b'{"model": "x"')


def counted(metrics_text: str, metric: str, route: str, status: int) -> float:
    """The value of ``metric{route=..., status=...}`` in a Prometheus text page (0 when absent)."""
    pattern = re.compile(rf'^{metric}\{{(?=[^}}]*route="{re.escape(route)}")(?=[^}}]*status="{status}")[^}}]*\}} '
                         r"(\S+)$", re.M)
    return sum(float(value) for value in pattern.findall(metrics_text))
