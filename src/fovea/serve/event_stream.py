"""A server-sent-event response over a request the engine has already admitted.

The request is submitted before this response is built, so a refusal (429 with Retry-After,
400) is an ordinary JSON answer and never a 200 whose stream stops. ``on_close`` cancels the
engine request however the response ends, even when its body never started (a client gone
before the first byte): the engine then drops it instead of generating for no one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict | str) -> str:
    """One ``data:`` event (a dict as compact JSON, a string such as ``[DONE]`` as it is)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class EventStream(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=HEADERS)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
