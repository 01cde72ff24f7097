"""uvicorn's HTTP/1.1 protocol with a deadline for each request's head.

uvicorn closes an idle keep-alive connection only after a response, and any byte received
cancels that timer: a client that connects and sends nothing, or drips one byte at a time, holds
a connection (a file descriptor and its buffers) forever. Here a connection must deliver a
complete request head within ``HEAD_TIMEOUT_S`` of connecting or of its previous response,
or it is closed.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0


class DeadlineH11Protocol(H11Protocol):
    head_timeout_s = HEAD_TIMEOUT_S

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
            self._arm_head_deadline()  # the next request on this connection gets the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.head_timeout_s, self._head_too_late)

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
    return {"http": DeadlineH11Protocol, "timeout_keep_alive": 5}
