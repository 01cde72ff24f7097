"""Refuse request bodies over the limit with 413, whether or not they declare their length."""

from __future__ import annotations

import json

from fovea.errors import FoveaError


class RequestTooLarge(FoveaError):
    status, code = 413, "request_too_large"


def _too_large(limit: int, size: int | None) -> RequestTooLarge:
    seen = f"is {size} bytes" if size is not None else f"exceeds {limit} bytes"
    return RequestTooLarge(f"the request body {seen}; the limit is {limit} bytes (--max-body-bytes). "
                           "Send smaller images, or upload them once with POST /v1/images and refer to them by id.")


class BodyLimitMiddleware:
    """Pure ASGI: checks Content-Length up front; reads and counts bodies that declare no length."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, _too_large(self.max_bytes, int(declared)))
            return
        if declared is not None:
            await self.app(scope, receive, send)  # the server enforces the declared length
            return
        # A body without a declared length (chunked): read it here, counting, then replay it.
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message]), send)  # a disconnect: let the app see it
                return
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                await self._refuse(send, _too_large(self.max_bytes, None))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}],
                                      receive), send)

    @staticmethod
    async def _refuse(send, error: FoveaError) -> None:
        body = json.dumps(error.to_body()).encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[dict], then=None):
    """An ASGI receive that hands out ``messages`` first, then defers to ``then``."""
    pending = list(messages)

    async def receive():
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive
