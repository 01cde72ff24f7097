"""fovea's logging: ``--log-format text|json``, ``--log-level``, and a request id on every line a
request causes.

The id comes from the client's ``X-Request-Id`` header when it is a sane token (so a proxy's id
carries through), else one is made; it is set in a context variable for the request's task, put
on each log record by a filter, and returned in the response's ``X-Request-Id`` header. Each
request ends with one ``fovea.access`` line: route, status, duration, and for a refusal its
error code; a finished generation adds one ``fovea.request`` line with the numbers the metrics
observed (time to first token, tokens, encoder time), so a line, a metric sample and an error
body that a client reports can be tied together by the id.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("fovea_request_id", default=None)
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error", "critical")
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "request_id"}


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, request_id, and any ``extra`` fields."""

    def __init__(self, who: str | None = None) -> None:
        super().__init__()
        self.who = who

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage(),
        }
        if self.who:
            out["process"] = self.who
        if getattr(record, "request_id", None):
            out["request_id"] = record.request_id
        out |= {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self, who: str | None = None) -> None:
        super().__init__(f"%(asctime)s %(levelname)s {who + ' ' if who else ''}%(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        rid = getattr(record, "request_id", None)
        return f"{line} [{rid}]" if rid else line


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a line is written, not when the handler was made
    (as logging's own last-resort handler does): an embedding program or a test runner that
    swaps stderr, then closes the old one, gets no 'I/O operation on closed file' from threads
    that log later."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # (StreamHandler's __init__ sets it)


_configured: tuple[str, str] = ("info", "text")


def configured() -> tuple[str, str]:
    """The level and format of the last ``configure`` (what a child process should log with)."""
    return _configured


def configure(level: str = "info", fmt: str = "text", who: str | None = None, stream: Any = None) -> None:
    """Set up the root logger (and uvicorn's, which fovea's access lines replace).

    A second call replaces the handler the first one added; handlers that fovea did not add stay
    (a host program's own, or pytest's capture, which ``caplog`` reads)."""
    global _configured
    _configured = (level, fmt)
    formatter = JsonFormatter(who) if fmt == "json" else TextFormatter(who)
    handler = logging.StreamHandler(stream) if stream is not None else StderrHandler()
    handler.setFormatter(formatter)
    handler.addFilter(RequestIdFilter())
    handler._fovea = True  # type: ignore[attr-defined]
    unconfigure()
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # fovea.access has the id, the route and the code
    quiet_progress_unless_tty()


def unconfigure() -> None:
    """Remove the handler ``configure`` added, and nothing else (a test that ran the CLI in-process
    is done with it)."""
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not getattr(h, "_fovea", False)]


def quiet_progress_unless_tty() -> None:
    """transformers draws its weight-loading bar even into a log file; only on a terminal here."""
    if sys.stderr.isatty():
        return
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]
access_log = logging.getLogger("fovea.access")


class RequestIdMiddleware:
    """Gives each HTTP request an id (see the module's docstring) and logs its access line."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = None
        for name, value in scope.get("headers") or ():
            if name == b"x-request-id":
                text = value.decode("latin-1")
                rid = text if _CLIENT_ID.fullmatch(text) else None
                break
        rid = rid or "req-" + uuid.uuid4().hex[:16]
        # Downstream sees the id as if the client had sent it (a front forwards it to its PD worker).
        scope["headers"] = [*(h for h in scope.get("headers") or () if h[0] != b"x-request-id"),
                            (b"x-request-id", rid.encode())]
        token = REQUEST_ID.set(rid)
        started, status, error_body = time.perf_counter(), 500, bytearray()

        async def tagged_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                kept = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]  # a worker's copy
                message["headers"] = [*kept, (b"x-request-id", rid.encode())]
            elif message["type"] == "http.response.body" and status >= 400 and len(error_body) < 16384:
                error_body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, tagged_send)
        finally:
            fields: dict[str, Any] = {"method": scope.get("method"), "path": scope.get("path"), "status": status,
                                      "duration_ms": round(1000 * (time.perf_counter() - started), 3)}
            code = _error_code(bytes(error_body))
            if code:
                fields["error_code"] = code
            access_log.log(logging.WARNING if status >= 500 else logging.INFO,
                           "%s %s %d %.1f ms%s", fields["method"], fields["path"], status, fields["duration_ms"],
                           f" {code}" if code else "", extra=fields)
            REQUEST_ID.reset(token)


def _error_code(body: bytes) -> str | None:
    try:
        error = json.loads(body).get("error") if body else None
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None
