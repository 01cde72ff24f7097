"""HTTP/1.1 framing errors: refused with a 400 that closes the connection (RFC 9112 §6.3).

A request whose body length is ambiguous (both Content-Length and Transfer-Encoding) or invalid
(a bad Content-Length, a bad chunk) leaves the server unsure where the next request starts: a
"pipelined" request after it may be one the client never meant to send (request smuggling, when
a proxy in front reads the length the other way). h11 reads Content-Length + Transfer-Encoding by
the Transfer-Encoding alone and keeps the connection open; here such a request is refused before
the app sees it, and every framing error ends the connection after its 400, so nothing that
follows on it is served.
"""

from __future__ import annotations

import json

import h11

from fovea.errors import FoveaError

_MAX_DETAIL = 200  # h11's reasons quote the client's bytes; a sentence is enough


class BadFraming(FoveaError):
    status, code = 400, "invalid_http_framing"


class FramingConnection(h11.Connection):
    """h11's server connection that also refuses Content-Length with Transfer-Encoding, and
    keeps the last protocol error so the 400 can say what it was."""

    def __init__(self, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self.last_error: h11.RemoteProtocolError | None = None

    def next_event(self):  # type: ignore[no-untyped-def]  # h11's own signature
        try:
            event = super().next_event()
            if isinstance(event, h11.Request) and _ambiguous_length(event.headers):
                raise h11.RemoteProtocolError("the request has both Content-Length and Transfer-Encoding",
                                              error_status_hint=400)
        except h11.RemoteProtocolError as exc:
            self.last_error = exc
            raise
        return event


def _ambiguous_length(headers: list[tuple[bytes, bytes]]) -> bool:
    names = {name.lower() for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


def refusal(error: h11.RemoteProtocolError | None) -> tuple[int, bytes]:
    """(status, JSON body) for the response to a request h11 could not frame."""
    detail = str(error)[:_MAX_DETAIL] if error is not None else "malformed request"
    status = error.error_status_hint if error is not None else 400
    body = BadFraming(f"the request is not valid HTTP ({detail}). Send its body with one Content-Length or "
                      "with Transfer-Encoding: chunked, never both; the connection is closed after this "
                      "response (RFC 9112 §6.3).", status=status).to_body()
    return status, json.dumps(body).encode()
