"""HTTP errors in the OpenAI API's shape: ``{"error": {"message", "type", "param", "code"}}``.

Clients that speak the OpenAI API map these statuses onto their own exception
types (the ``openai`` package raises ``BadRequestError`` for 400,
``AuthenticationError`` for 401, ``NotFoundError`` for 404, ``RateLimitError`` for 429).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

_log = logging.getLogger("kvstate.serve")
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


def internal_error(exc: BaseException, where: str) -> HTTPError:
    """A 500 that names only an opaque request id; the exception goes to the server log under that id."""
    request_id = "req_" + uuid.uuid4().hex
    _log.error("request %s (%s) failed", request_id, where, exc_info=(type(exc), exc, exc.__traceback__))
    return HTTPError(f"The server had an error while processing your request (request id {request_id}); the "
                     "server log has the details.", status=500, code="internal_error")


def validation_error(errors: Sequence[Any]) -> BadRequest:
    """A request body the schema refused, as OpenAI words it: an unknown field first, else the first
    failure with its dotted path as ``param`` (the input itself is never echoed)."""
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    error = (unknown or list(errors) or [{"type": "", "loc": (), "msg": "invalid request body"}])[0]
    param = _param(error.get("loc", ()))
    if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):  # the tag field names the error
        param += "." + str((error.get("ctx") or {}).get("discriminator", "")).strip("'")
    if error.get("type") == "json_invalid":
        return BadRequest("the body is not valid JSON", fix="send a JSON object")
    if unknown:
        return BadRequest(f"Unrecognized request argument supplied: {param}", param=param)
    if error.get("type") == "missing":
        return BadRequest(f"'{param}' is required", param=param) if param else \
            BadRequest("the body is required: a JSON object", fix="send the request as JSON")
    where = f"'{param}'" if param else "the body"
    return BadRequest(f"{where}: {error.get('msg', 'invalid')}", param=param or None, code="invalid_value")


_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})
_ROLES = frozenset({"system", "developer", "user", "assistant"})


def _param(loc: Sequence[Any]) -> str:
    """``("body", "messages", 0, "user", "content", "str")`` -> ``messages[0].content``: field names and
    indices, without the role tag of a message, up to the first union branch tag pydantic adds."""
    out, previous = "", None
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif isinstance(previous, int) and item in _ROLES:
            pass  # the message kind pydantic chose by its role
        elif isinstance(item, str) and item.isidentifier() and item not in _TAGS:
            out += f".{item}" if out else item
        else:
            break
        previous = item
    return out
