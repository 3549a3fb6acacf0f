"""The ASGI app: OpenAI's routes over one ``Runner``, with keys, limits and server-sent events.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming or not,
``n=1``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text).
The ``/v1`` routes need ``Authorization: Bearer <key>`` when the server has keys;
each key's conversations live in their own namespace of the pool and the store,
so tenants never share (or time) each other's prefixes. Request bodies over
``max_request_bytes`` are a 413 before they are read in full. Bodies are the strict
models of ``schema.py``, published at ``/openapi.json``: whatever they refuse is a 400
in OpenAI's shape. A 500 names only an opaque request id; its details go to the log.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import KVStateError
from .errors import BadRequest, HTTPError, internal_error, validation_error
from .logprobs import TokenLogprob, chat_shape, completion_shape, pieces
from .metrics import CONTENT_TYPE
from .params import CHAT_FIELDS, COMPLETION_FIELDS, Limits, parse
from .runner import Cancelled, Job, Result, shutting_down
from .schema import (
    ChatChunk,
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionChunk,
    CompletionRequest,
    ErrorBody,
    Health,
    ModelCard,
    ModelList,
    event_schema,
)
from .server import Server
from .shutdown import CloseWhileDraining


def create_app(server: Server) -> FastAPI:
    """The FastAPI app serving ``server``'s model."""
    app = FastAPI(title="kvstate serve", version=server.version, docs_url=None, redoc_url=None)
    app.state.server = server
    app.add_middleware(_BodyLimit, limit=server.max_request_bytes)
    app.add_middleware(CloseWhileDraining, stopping=server.stopping)
    app.openapi = lambda: _openapi(app, server.limits)  # type: ignore[method-assign]

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
        server.metrics.request(_route(request), exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await _http_error(request, validation_error(exc.errors()))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:  # never a traceback, nor its text
        return await _http_error(request, internal_error(exc, f"{request.method} {_route(request)}"))

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = HTTPError(f"{request.method} {request.url.path[:200]}: {exc.detail}", status=exc.status_code)
        return await _http_error(request, error)

    @app.get("/health", response_model=None,
             responses={**_responses(Health), 503: {"model": Health, "description": "Draining: shutting down"}})
    async def health() -> Response:  # 503 while draining, so a load balancer stops sending requests here
        return JSONResponse(server.health(), status_code=503 if server.stopping.is_set() else 200)

    @app.get("/metrics", response_class=PlainTextResponse, responses=_responses(None))
    async def metrics() -> Response:  # off the event loop: a Redis store's counters are read over the network
        body = await asyncio.get_running_loop().run_in_executor(None, server.metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=None, responses=_responses(ModelList, auth=True))
    async def models(namespace: Caller) -> dict[str, Any]:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=None, responses=_responses(ModelCard, auth=True, found=True))
    async def model(namespace: Caller, model_id: str) -> dict[str, Any]:
        _check_model(server, model_id)
        return server.model_card()

    @app.post("/v1/chat/completions", response_model=None, responses=_responses(ChatCompletion, auth=True, body=True))
    async def chat(request: Request, namespace: Caller, body: ChatRequest) -> Response:
        return await _complete(server, request, namespace, body.model_dump(exclude_unset=True), chat=True)

    @app.post("/v1/completions", response_model=None, responses=_responses(Completion, auth=True, body=True))
    async def completions(request: Request, namespace: Caller, body: CompletionRequest) -> Response:
        return await _complete(server, request, namespace, body.model_dump(exclude_unset=True), chat=False)

    return app


def _responses(ok: type | None, *, auth: bool = False, found: bool = False, body: bool = False) -> dict[Any, Any]:
    """The statuses a route answers, for ``/openapi.json``: 200 (server-sent events too for a body), the
    OpenAI error shape otherwise."""
    success: dict[str, Any] = {"description": "OK"}
    if ok is not None:
        success["model"] = ok
    if body:  # the event schema is filled in by _openapi, where the chunk models are in components
        success["content"] = {"text/event-stream": {"schema": {}}}
    codes = [500, *([401] if auth else []), *([404] if found or body else []),
             *([400, 413, 429, 503] if body else [])]  # 503: the server is shutting down
    return {200: success, **{code: {"model": ErrorBody, "description": "An OpenAI error"} for code in codes}}


def _openapi(app: FastAPI, limits: Limits) -> dict[str, Any]:
    """FastAPI's schema, without the 422 it documents by default (validation failures are a 400 here),
    with the streams' events described by their chunk models and this server's stop-string limits."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for request in ("ChatRequest", "CompletionRequest"):
            _bound_stop(components[request]["properties"]["stop"], limits)
        for path, chunk in (("/v1/chat/completions", ChatChunk), ("/v1/completions", CompletionChunk)):
            found = chunk.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(found.pop("$defs", {}))
            components[chunk.__name__] = found
            content = schema["paths"][path]["post"]["responses"]["200"]["content"]
            content["text/event-stream"] = {"schema": event_schema(chunk)}
        app.openapi_schema = schema
    return app.openapi_schema


def _bound_stop(stop: dict[str, Any], limits: Limits) -> None:
    """The published ``stop`` schema with the server's limits (``--max-stop-strings``, ``--max-stop-length``),
    which ``params`` enforces: a string, or an array of strings."""
    for branch in stop.get("anyOf", ()):
        if branch.get("type") == "string":
            branch["maxLength"] = limits.max_stop_length
        elif branch.get("type") == "array":
            branch["maxItems"] = limits.max_stop_strings
            branch["items"]["maxLength"] = limits.max_stop_length


class _BodyLimit:
    """Counts a request body as it arrives: over ``limit`` bytes (declared or sent) is a 413 before the
    rest is read."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        size = 0

        async def limited() -> dict[str, Any]:
            nonlocal size
            if declared.isdigit() and int(declared) > self.limit:
                raise StarletteHTTPException(413, f"request body of {int(declared)} bytes is over the limit of "
                                                  f"{self.limit}")
            message = await receive()
            size += len(message.get("body", b""))
            if size > self.limit:
                raise StarletteHTTPException(413, f"request body is over the limit of {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


def _route(request: Request) -> str:
    """The route's template (not the raw path), so metric labels stay few whatever clients send."""
    route = request.scope.get("route")
    return getattr(route, "path", "unmatched")


def _namespace(request: Request) -> str:
    """The caller's namespace: one per API key (a hash, never the key), or ``default`` without keys.
    A dependency, so a missing key is a 401 before the body is validated."""
    server: Server = request.app.state.server
    if not server.api_keys:
        return "default"
    header = request.headers.get("authorization", "")
    token = header[7:].strip() if header[:7].lower() == "bearer " else ""
    for key in server.api_keys:
        if hmac.compare_digest(token.encode(), key.encode()):
            return "key-" + hashlib.sha256(key.encode()).hexdigest()[:24]
    raise HTTPError("Incorrect API key provided." if token else "Missing API key: send 'Authorization: Bearer <key>'",
                    status=401, code="invalid_api_key")


Caller = Annotated[str, Depends(_namespace)]


def _check_model(server: Server, name: Any) -> None:
    if not isinstance(name, str):
        raise BadRequest("'model' is required: a string", param="model")
    if name != server.model_id:  # a name is only compared, never opened or fetched
        raise HTTPError(f"The model `{name[:200]}` does not exist or you do not have access to it. This server "
                        f"serves `{server.model_id}`.", status=404, code="model_not_found", param="model")


async def _complete(server: Server, request: Request, namespace: str, body: dict[str, Any], *,
                    chat: bool) -> Response:
    if server.stopping.is_set():
        raise shutting_down()
    _check_model(server, body["model"])
    loop = asyncio.get_running_loop()
    # rendering decodes images and tokenizes: off the event loop
    prompt, inputs = await loop.run_in_executor(
        None, server.render, body.get("messages") if chat else body.get("prompt"), chat)
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    req = parse(body, fields, server.limits, prompt.default_stop, None if chat else 16, server.vocab)
    server.check_prompt(prompt, req.options["max_new_tokens"])
    job = Job(namespace, prompt, req, inputs, marks=server.marks_for(chat, prompt.ids))
    kind = "chat.completion" if chat else "text_completion"
    reply = _Reply(server.model_id, kind, chat)
    if req.stream:
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        if req.logprobs is None:
            job.on_text = lambda text: loop.call_soon_threadsafe(queue.put_nowait, ("text", text))
        else:  # one chunk per token, its piece of the answer with its logprobs, as soon as the piece is final
            job.on_token = lambda piece, item: loop.call_soon_threadsafe(queue.put_nowait, ("token", (piece, item)))
        future = server.runner.submit(job)
        future.add_done_callback(lambda f: loop.call_soon_threadsafe(queue.put_nowait, ("done", f)))
        server.metrics.request(_route(request), 200)
        return StreamingResponse(_events(reply, job, queue, req.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    future = server.runner.submit(job)
    watcher = asyncio.create_task(_watch(request, job))
    try:
        result = await asyncio.wrap_future(future)
    except Cancelled:
        return Response(status_code=499)
    except KVStateError as exc:
        raise BadRequest(str(exc)) from exc
    finally:
        watcher.cancel()
    server.metrics.request(_route(request), 200)
    return JSONResponse(reply.whole(result))


async def _watch(request: Request, job: Job) -> None:
    """Cancel the job when the client of a non-streaming request disconnects."""
    while not job.cancelled.is_set():
        if await request.is_disconnected():
            job.cancelled.set()
            return
        await asyncio.sleep(0.2)


async def _events(reply: _Reply, job: Job, queue: asyncio.Queue[tuple[str, Any]],
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a role chunk, text chunks, the finish chunk, usage if asked, ``[DONE]``.
    Leaving early (the client disconnected) cancels the job."""
    done, tokens = False, 0
    try:
        yield _sse(reply.chunk(role=True))
        while True:
            what, value = await queue.get()
            if what == "text":
                yield _sse(reply.chunk(text=value))
                continue
            if what == "token":
                tokens += 1
                yield _sse(reply.chunk(text=value[0], logprobs=(value[1],)))
                continue
            done = True
            try:
                result: Result = value.result()
            except Exception as exc:  # headers are sent: the error travels as an event, as OpenAI's do
                failure = exc if isinstance(exc, HTTPError) else BadRequest(str(exc)) \
                    if isinstance(exc, KVStateError) else internal_error(exc, "a stream")
                yield _sse(failure.body())
                break
            while not queue.empty():  # text queued before the done callback ran
                what, value = queue.get_nowait()
                if what == "token":
                    tokens += 1
                yield _sse(reply.chunk(text=value) if what == "text" else
                           reply.chunk(text=value[0], logprobs=(value[1],)))
            if result.logprobs is not None:  # tokens not streamed live (a run that gave no per-step logits)
                for piece, item in list(zip(pieces(result.logprobs, result.text), result.logprobs,
                                            strict=True))[tokens:]:
                    yield _sse(reply.chunk(text=piece, logprobs=(item,)))
            yield _sse(reply.chunk(finish=result.finish_reason))
            if include_usage:
                yield _sse(reply.usage_chunk(result))
            break
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            job.cancelled.set()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Reply:
    """OpenAI response objects for one request."""

    def __init__(self, model_id: str, kind: str, chat: bool) -> None:
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.model, self.kind, self.chat, self.created = model_id, kind, chat, int(time.time())

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def whole(self, result: Result) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason,
                                  "logprobs": self._logprobs(result.logprobs)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return {**self._head(self.kind), "choices": [choice], "usage": _usage(result)}

    def chunk(self, *, text: str = "", role: bool = False, finish: str | None = None,
              logprobs: tuple[TokenLogprob, ...] | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else \
                {} if finish else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": self._logprobs(logprobs)}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": self._logprobs(logprobs)}
        return {**self._head("text_completion"), "choices": [choice]}

    def _logprobs(self, items: tuple[TokenLogprob, ...] | None) -> dict[str, Any] | None:
        if items is None:
            return None
        return chat_shape(items) if self.chat else completion_shape(items)

    def usage_chunk(self, result: Result) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": _usage(result)}


def _usage(result: Result) -> dict[str, Any]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}
