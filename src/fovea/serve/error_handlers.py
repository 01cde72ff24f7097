"""Every failure becomes an OpenAI-style JSON error; nothing escapes as a bare 500 page."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from fovea.errors import FoveaError

log = logging.getLogger("fovea.serve")

_FASTAPI_PARSE_ERROR = "There was an error parsing the body"
# nginx's "client closed request": what a request whose client left while sending its body is
# counted and logged as. Nobody reads the response.
CLIENT_CLOSED = 499
_HTTP_CODES = {401: "unauthorized", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def error_body(message: str, code: str, param: str | None = None, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# Schema errors that name a key fovea does not take (or takes only as null): unsupported_parameter.
UNSUPPORTED_TYPES = frozenset({"extra_forbidden", "unsupported_parameter"})


def request_path(loc: tuple) -> list[str]:
    """The path of the request key at pydantic's ``loc``, without the union labels pydantic puts
    in it: branch names ("str", "TextPart", "list[tagged-union[...]]") and, after an index into
    a tagged union's list, the item's tag ("content", <label>, 1, "text", "foo" is content[1].foo)."""
    path: list[str] = []
    tagged = tag_next = False
    for p in loc:
        p = str(p)
        if p.isdigit():  # a list index, or a key such as logit_bias's "7"
            path.append(p)
            tag_next, tagged = tagged, False
            continue
        if tag_next:
            tag_next = False
            continue
        if not p.isidentifier() or p[:1].isupper() or p in {"str", "int"}:
            tagged = "tagged-union[" in p
            continue
        path.append(p)
    return path


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first schema error as one sentence plus the dotted path of the offending field."""
    errors = exc.errors()
    if not errors:
        return "the request body is invalid", None
    # With unions (content: str | list[part]) pydantic reports one error per branch; the
    # deepest one is the branch the client meant.
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = tuple(first.get("loc", ()))
    path = request_path(loc[1:] if loc[:1] == ("body",) else loc)
    param = ""
    for part in path:
        param += f"[{part}]" if part.isdigit() else (f".{part}" if param else part)
    message = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "missing":
        return f"{param or 'a field'} is required", param or None
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{param or 'request'}: {message}{more}", param or None


def _client_closed() -> JSONResponse:
    return JSONResponse(error_body("the client closed the connection before its request body arrived",
                                   "client_disconnected"), status_code=CLIENT_CLOSED)


def install_error_handlers(app: FastAPI, on_error_code: Callable[[str], None] | None = None) -> None:
    @app.exception_handler(FoveaError)
    async def _fovea(request: Request, exc: FoveaError) -> JSONResponse:
        if on_error_code is not None:
            on_error_code(exc.code)
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.to_body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        # A key the schema forbids (stream_options.unknown, fovea.unknown) is a
        # parameter fovea does not support, never one it ignores.
        forbidden = any(e.get("type") in UNSUPPORTED_TYPES for e in exc.errors())
        if forbidden:
            message = f"{message}: fovea does not support this field; remove it (docs/api.md lists every field)"
        code = "unsupported_parameter" if forbidden else "invalid_request"
        return JSONResponse(error_body(message, code, param), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def _disconnect(request: Request, exc: ClientDisconnect) -> JSONResponse:
        return _client_closed()  # one access line, counted; not a traceback

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, ClientDisconnect):  # FastAPI's body parser wraps it in a 400
            return _client_closed()
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        message = str(exc.detail)
        if exc.status_code == 400:
            # FastAPI's own 400 is a body it could not parse (JSON nested past the parser's
            # depth, bytes that are not UTF-8): the README's invalid_request, not a bare HTTP error.
            code = "invalid_request"
            if message == _FASTAPI_PARSE_ERROR:
                message = ("the request body is not valid JSON (it could not be parsed: nested too deeply, "
                           "or not UTF-8 text)")
        return JSONResponse(error_body(message, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(
            error_body("internal error; the server logged the details", "internal_error", type_="server_error"),
            status_code=500,
        )
