"""HTTP errors in the OpenAI API's shape: ``{"error": {"message", "type", "param", "code"}}``.

Clients that speak the OpenAI API map these statuses onto their own exception
types (the ``openai`` package raises ``BadRequestError`` for 400,
``AuthenticationError`` for 401, ``NotFoundError`` for 404, ``RateLimitError`` for 429).
"""

from __future__ import annotations

from typing import Any

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          413: "invalid_request_error", 429: "requests", 500: "server_error", 503: "server_error"}


class HTTPError(Exception):
    """An error answered to the client with ``status`` and the OpenAI error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 fix: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message + (f"; fix: {fix}" if fix else ""))
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


class BadRequest(HTTPError):
    """The request is malformed or asks for something this server does not do (400, or 413 for size)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None,
                 fix: str | None = None) -> None:
        super().__init__(message, status=status, param=param, code=code, fix=fix)
