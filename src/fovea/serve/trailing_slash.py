"""``/v1/models/`` is served as ``/v1/models``, in place: no redirect.

Starlette's slash redirect builds its ``Location`` from the client's ``Host`` header, so a
request with ``Host: evil.example`` was sent to ``http://evil.example/v1/models``. fovea turns
that redirect off and strips the trailing slash before routing instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable, Callable], Awaitable[None]]


class StripTrailingSlash:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if len(path) > 1 and path.endswith("/"):
                scope = dict(scope)
                scope["path"] = path.rstrip("/") or "/"
                raw = scope.get("raw_path")
                if raw:
                    scope["raw_path"] = raw.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)
