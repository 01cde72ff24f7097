"""uvicorn's HTTP/1.1 protocol with a deadline for each request's head, and its keep-alive settings.

uvicorn closes an idle keep-alive connection only after a response, and any byte received
cancels that timer: a client that connects and sends nothing, or drips one byte at a time, holds
a connection (a file descriptor and its buffers) forever. Here a connection must deliver a
complete request head within ``HEAD_TIMEOUT_S`` of connecting, or within the keep-alive time
plus that of its previous response, or it is closed.

Keep-alive lasts ``KEEP_ALIVE_S``, longer than the idle expiry of the usual clients' pools
(httpx 5 s, aiohttp 15 s): a pool then drops an idle connection before the server closes it.
When both close at about the same moment, a request sent on the closing connection fails with a
read error on the client (one such failure in 3,178 requests of the 2026-12-01 H200 run, with
uvicorn's 5 s against httpx's 5 s).

A request h11 cannot frame (see ``http_framing``) is answered with a JSON 400 and the connection
is closed, so no request pipelined after it is served.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from fovea.serve.http_framing import FramingConnection, refusal

HEAD_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 30


class DeadlineH11Protocol(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]  # uvicorn's own
        super().__init__(*args, **kwargs)
        # The same limit uvicorn gave its own connection (--h11-max-incomplete-event-size).
        self.conn: FramingConnection = FramingConnection(self.conn._max_incomplete_event_size)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused, as a fovea error; the connection closes
        after it either way (and at once if the app has already begun its response)."""
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no response begun
            status, body = refusal(self.conn.last_error)
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            self.transport.write(self.conn.send(h11.Response(status_code=status, headers=headers,
                                                             reason=STATUS_PHRASES[status])))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request head has been parsed
            self._cancel_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            # The next request may come any time within keep-alive; its head then has the same deadline.
            self._arm_head_deadline(self.timeout_keep_alive + self.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self, seconds: float | None = None) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(seconds or self.head_timeout_s, self._head_too_late)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_too_late(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def uvicorn_options() -> dict:
    """The options fovea runs uvicorn with (the CLI and the tests' servers alike)."""
    return {"http": DeadlineH11Protocol, "timeout_keep_alive": KEEP_ALIVE_S}
