"""The API key check and the per-route request counter, as one pure ASGI middleware.

Pure ASGI rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware re-streams every
response body through a task group and memory streams, and a streamed completion sends one body
message per token. Replacing it took the event loop from 6.2 to 3.8 CPU ms per streamed request
on the demo model (bench/http_host_cost.py, docs/benchmarks.md): time the engine thread no
longer waits for the GIL.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fovea.serve.error_handlers import error_body
from fovea.serve.playground_route import PAGES

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# /health: load balancers probe it without credentials. / and its scripts: the playground page,
# static and secret-free; every API call it makes still needs the key.
OPEN_PATHS = frozenset({"/health", *PAGES})
_UNAUTHORIZED = json.dumps(error_body("a valid API key is required: send 'Authorization: Bearer <key>'.",
                                      "invalid_api_key")).encode()


class RequestGate:
    """Refuses requests without ``Authorization: Bearer <api_key>`` (when a key is set) with 401,
    and reports every response's route and status to ``count`` when its headers go out."""

    def __init__(self, app: ASGIApp, api_key: str | None, count: Callable[[str, int], None]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.expected is not None and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            self.count(_route(scope), 401)
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": _UNAUTHORIZED})
            return
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.count(_route(scope), int(message["status"]))  # the router has set scope["route"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:  # the server's last-resort handler answers 500
                self.count(_route(scope), 500)
            raise

    def _authorized(self, scope: Scope) -> bool:
        supplied = b""
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                supplied = value
                break
        return hmac.compare_digest(supplied, self.expected or b"")


def _route(scope: Scope) -> str:
    return getattr(scope.get("route"), "path", "unmatched")
