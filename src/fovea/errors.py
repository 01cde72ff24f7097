"""Errors a client can act on: an HTTP status, a machine-readable code and a plain sentence.

Every refusal in fovea is a ``FoveaError``. The server turns it into an OpenAI-style body
``{"error": {"message", "type", "param", "code"}}``; the CLI prints the message.
"""

from __future__ import annotations


class FoveaError(Exception):
    """A refusal with a stable ``code`` (snake_case) and the HTTP ``status`` it maps to."""

    status: int = 400
    code: str = "invalid_request"
    type: str = "invalid_request_error"

    def __init__(self, message: str, *, code: str | None = None, status: int | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.param = param

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self):
        # Refusals cross process boundaries (the preprocessing workers) whole: code, status, param.
        return (_rebuild, (type(self), self.message, self.code, self.status, self.param))


def _rebuild(cls: type[FoveaError], message: str, code: str, status: int, param: str | None) -> FoveaError:
    error = cls.__new__(cls)
    FoveaError.__init__(error, message, code=code, status=status, param=param)
    return error


class InvalidRequest(FoveaError):
    status, code = 400, "invalid_request"


class InvalidImage(FoveaError):
    status, code = 400, "invalid_image"


class ModelLoadError(FoveaError):
    """The model directory cannot be served; raised at start-up, never per request."""

    status, code, type = 500, "model_load_failed", "server_error"


class Overloaded(FoveaError):
    status, code, type = 429, "server_overloaded", "rate_limit_error"
