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
    """A request body the schema refused, as OpenAI words it: an unknown field first, else the first field's
    failure (``_chosen``: the union branch that took the input furthest) with its dotted path as ``param``
    (the input itself is never echoed)."""
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    error = unknown[0] if unknown else _chosen(list(errors)) or {"type": "", "loc": (), "msg": "invalid request body"}
    loc = error.get("loc", ())
    param, path = _param(loc), _param(loc, whole=True)
    if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):  # the tag field names the error
        tag = "." + str((error.get("ctx") or {}).get("discriminator", "")).strip("'")
        param, path = (param + tag if path == param else param), path + tag
    if error.get("type") == "json_invalid":
        return BadRequest("the body is not valid JSON", fix="send a JSON object")
    if unknown:
        return BadRequest(f"Unrecognized request argument supplied: {param}", param=param)
    if error.get("type") == "missing":
        return BadRequest(f"'{param}' is required", param=param) if param else \
            BadRequest("the body is required: a JSON object", fix="send the request as JSON")
    where = f"'{path}'" if path else "the body"
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    return BadRequest(f"{where}: {message}", param=param or None, code="invalid_value")


def _chosen(errors: list[Any]) -> Any:
    """The first field's error that says what is wrong with the input. A union field (``stop``: a string or a
    list of strings) gets one error per branch; the branches that refuse the input's kind (a list is not a
    string) are the least telling, and of the rest the deepest names the element at fault."""
    if not errors:
        return None
    field = _param(errors[0].get("loc", ()))
    same = [e for e in errors if _param(e.get("loc", ())) == field]
    return max(same, key=lambda e: (not str(e.get("type", "")).endswith("_type"), len(e.get("loc", ()))))


_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})
_ROLES = frozenset({"system", "developer", "user", "assistant"})


def _param(loc: Sequence[Any], whole: bool = False) -> str:
    """``("body", "messages", 0, "user", "content", "str")`` -> ``messages[0].content``: field names and
    indices, without the role tag of a message, up to the first union branch tag pydantic adds (``whole``:
    past the branch tags too, to the element at fault)."""
    out, previous = "", None
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif isinstance(previous, int) and item in _ROLES:
            pass  # the message kind pydantic chose by its role
        elif isinstance(item, str) and item.isidentifier() and item not in _TAGS:
            out += f".{item}" if out else item
        elif not whole:
            break
        previous = item
    return out
