"""The ASGI app: OpenAI's routes over one ``Runner``, with keys, limits and server-sent events.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming or not,
``n=1``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text).
The ``/v1`` routes need ``Authorization: Bearer <key>`` when the server has keys;
each key's conversations live in their own namespace of the pool and the store,
so tenants never share (or time) each other's prefixes. Request bodies over
``max_request_bytes`` are a 413 before they are read in full.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import KVStateError
from .errors import BadRequest, HTTPError
from .params import CHAT_FIELDS, COMPLETION_FIELDS, parse
from .runner import Cancelled, Job, Result
from .server import Server


def create_app(server: Server) -> FastAPI:
    """The FastAPI app serving ``server``'s model."""
    app = FastAPI(title="kvstate serve", version=server.version, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
        server.metrics.request(_route(request), exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:  # never a bare traceback
        return await _http_error(request, HTTPError(f"internal error: {type(exc).__name__}: {exc}", status=500))

    @app.exception_handler(StarletteHTTPException)
    async def _starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        error = HTTPError(f"{request.method} {request.url.path[:200]}: {exc.detail}", status=exc.status_code)
        return await _http_error(request, error)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return server.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(server.render_metrics(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _namespace(server, request)
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        _namespace(server, request)
        _check_model(server, model_id)
        return server.model_card()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _complete(server, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(server, request, chat=False)

    return app


def _route(request: Request) -> str:
    """The route's template (not the raw path), so metric labels stay few whatever clients send."""
    route = request.scope.get("route")
    return getattr(route, "path", "unmatched")


def _namespace(server: Server, request: Request) -> str:
    """The caller's namespace: one per API key (a hash, never the key), or ``default`` without keys."""
    if not server.api_keys:
        return "default"
    header = request.headers.get("authorization", "")
    token = header[7:].strip() if header[:7].lower() == "bearer " else ""
    for key in server.api_keys:
        if hmac.compare_digest(token.encode(), key.encode()):
            return "key-" + hashlib.sha256(key.encode()).hexdigest()[:24]
    raise HTTPError("Incorrect API key provided." if token else "Missing API key: send 'Authorization: Bearer <key>'",
                    status=401, code="invalid_api_key")


async def _body(server: Server, request: Request) -> dict[str, Any]:
    """The JSON body, read up to ``max_request_bytes`` (a larger one is a 413 without reading the rest)."""
    limit = server.max_request_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"request body of {declared} bytes is over the limit of {limit}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body is over the limit of {limit} bytes", status=413)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _check_model(server: Server, name: Any) -> None:
    if not isinstance(name, str):
        raise BadRequest("'model' is required: a string", param="model")
    if name != server.model_id:  # a name is only compared, never opened or fetched
        raise HTTPError(f"The model `{name[:200]}` does not exist or you do not have access to it. This server "
                        f"serves `{server.model_id}`.", status=404, code="model_not_found", param="model")


async def _complete(server: Server, request: Request, *, chat: bool) -> Response:
    namespace = _namespace(server, request)
    body = await _body(server, request)
    _check_model(server, body.get("model"))
    loop = asyncio.get_running_loop()
    # rendering decodes images and tokenizes: off the event loop
    prompt, inputs = await loop.run_in_executor(
        None, server.render, body.get("messages") if chat else body.get("prompt"), chat)
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    req = parse(body, fields, server.limits, prompt.default_stop, None if chat else 16)
    server.check_prompt(prompt)
    job = Job(namespace, prompt, req, inputs)
    kind = "chat.completion" if chat else "text_completion"
    reply = _Reply(server.model_id, kind, chat)
    if req.stream:
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        job.on_text = lambda text: loop.call_soon_threadsafe(queue.put_nowait, ("text", text))
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
    done = False
    try:
        yield _sse(reply.chunk(role=True))
        while True:
            what, value = await queue.get()
            if what == "text":
                yield _sse(reply.chunk(text=value))
                continue
            done = True
            try:
                result: Result = value.result()
            except Exception as exc:  # headers are sent: the error travels as an event, as OpenAI's do
                failure = exc if isinstance(exc, HTTPError) else HTTPError(
                    str(exc), status=400 if isinstance(exc, KVStateError) else 500)
                yield _sse(failure.body())
                break
            while not queue.empty():  # text queued before the done callback ran
                _, text = queue.get_nowait()
                yield _sse(reply.chunk(text=text))
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
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        return {**self._head(self.kind), "choices": [choice], "usage": _usage(result)}

    def chunk(self, *, text: str = "", role: bool = False, finish: str | None = None) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else \
                {} if finish else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, result: Result) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": _usage(result)}


def _usage(result: Result) -> dict[str, Any]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}
