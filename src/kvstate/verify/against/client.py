"""A small, bounded OpenAI-compatible HTTP client (standard library only) for ``verify --against``.

It talks to the base URLs it is given and to nothing else: ``/v1/models``,
``/v1/chat/completions`` and ``/v1/completions`` (whole or streamed), and the cache-reset
routes engines expose on the same host (vLLM ``POST /reset_prefix_cache``, SGLang
``POST /flush_cache``, llama.cpp ``POST /slots/{id}?action=erase``). Every call has a
timeout and a bounded body. A reply records the text, the chosen tokens' logprobs where
the server returns them, and the cache hit the server reports, read from whichever field
that engine uses (``HIT_FIELDS``); ``None`` means the server reports no hit field at all.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ...errors import AgainstError

MAX_BODY = 32 << 20  # a reply larger than this is refused, not read
# where engines report prompt tokens served from their cache, most specific first
HIT_FIELDS = (
    ("usage", "prompt_tokens_details", "cached_tokens"),  # OpenAI, vLLM, SGLang (--enable-cache-report), kvstate
    ("timings", "cache_n"),  # llama.cpp server
    ("usage", "prompt_cache_hit_tokens"),  # DeepSeek-style
    ("usage", "cache_read_input_tokens"),  # Anthropic-style proxies
    ("usage", "cached_tokens"),
    ("meta_info", "cached_tokens"),  # SGLang's native API
    ("tokens_cached",),  # llama.cpp /completion
)
RESETS = ("POST /reset_prefix_cache", "POST /flush_cache", "llama.cpp slots")


@dataclass(frozen=True)
class Call:
    """One request: chat ``messages`` or a completion ``prompt``, greedy, ``max_tokens`` long."""

    messages: tuple[dict[str, Any], ...] = ()
    prompt: str | None = None
    max_tokens: int = 16
    stream: bool = False

    def body(self, model: str, logprobs: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "temperature": 0}
        if self.prompt is None:
            body["messages"] = list(self.messages)
            if logprobs:
                body.update(logprobs=True, top_logprobs=1)
        else:
            body["prompt"] = self.prompt
            if logprobs:
                body["logprobs"] = 1
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    @property
    def route(self) -> str:
        return "/v1/completions" if self.prompt is not None else "/v1/chat/completions"


@dataclass(frozen=True)
class Reply:
    """What a server answered: ``cached`` is the hit it reported (``None``: no hit field at all)."""

    text: str = ""
    prompt_tokens: int | None = None
    cached: int | None = None
    tokens: tuple[str, ...] | None = None  # the chosen tokens, where logprobs came back
    logprobs: tuple[float, ...] | None = None
    seconds: float = 0.0
    error: str | None = None
    status: int | None = None

    @property
    def hit(self) -> bool:
        return bool(self.cached)


@dataclass
class Client:
    """One server: ``url`` is its base (with or without ``/v1``)."""

    url: str
    api_key: str | None = None
    timeout: float = 60.0
    model: str = ""
    logprobs: bool = False
    sent: int = 0  # requests made, for the run's bound
    reset_route: str | None = field(default=None)

    def __post_init__(self) -> None:
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise AgainstError(f"not a server URL: {self.url!r}", expected="http://host:port or https://host/v1",
                               fix="pass the server's base URL")
        self.root = self.url.rstrip("/").removesuffix("/v1")

    def _request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """``(status, response)``: an open response for 2xx, the decoded error body otherwise."""
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.root + path, data=data, method=method, headers=headers)
        self.sent += 1
        try:
            return 200, urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            text = exc.read(64 << 10).decode("utf-8", "replace")
            try:
                message = json.loads(text).get("error", text)
                message = message.get("message", message) if isinstance(message, dict) else message
            except (ValueError, AttributeError):
                message = text
            return exc.code, str(message)[:300]

    def get_json(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        status, response = self._request(method, path, body)
        if status != 200:
            return status, response
        with response:
            raw = response.read(MAX_BODY + 1)
        if len(raw) > MAX_BODY:
            return 502, f"reply over {MAX_BODY} bytes"
        try:
            return status, json.loads(raw or b"null")
        except ValueError:
            return status, raw.decode("utf-8", "replace")[:300]

    def models(self) -> list[str]:
        """The served model ids; an unreachable server or a refused key is an ``AgainstError``."""
        try:
            status, data = self.get_json("GET", "/v1/models")
        except (OSError, urllib.error.URLError, http.client.HTTPException) as exc:
            raise AgainstError(f"cannot reach {self.root}: {getattr(exc, 'reason', exc)}",
                               fix="start the server, or check the URL and port") from exc
        if status == 404:  # a server without the route: the model id must come from --served-model
            return []
        if status != 200 or not isinstance(data, dict):
            raise AgainstError(f"{self.root}/v1/models answered {status}: {str(data)[:200]}",
                               fix="check --api-key and that the URL is an OpenAI-compatible server")
        return [str(m.get("id")) for m in data.get("data", []) if isinstance(m, dict)]

    def send(self, call: Call) -> Reply:
        """Run ``call``; a transport failure or an error status becomes ``Reply.error``, never an exception."""
        started = time.perf_counter()
        body = call.body(self.model, self.logprobs)
        try:
            status, response = self._request("POST", call.route, body)
            if status in (400, 422) and "stream_options" in body:  # a server that knows no stream_options
                del body["stream_options"]
                status, response = self._request("POST", call.route, body)
            if status != 200:
                return Reply(error=f"HTTP {status}: {response}", status=status)
            with response:
                payloads = _events(response) if call.stream else [_read_json(response)]
        except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError) as exc:
            return Reply(error=f"{type(exc).__name__}: {exc}"[:300])
        return _reply(payloads, time.perf_counter() - started)

    def find_reset(self) -> str | None:
        """The cache-reset route this server answers, tried in ``RESETS`` order (each is harmless elsewhere)."""
        for route in RESETS:
            if self._reset(route):
                self.reset_route = route
                return route
        return None

    def reset(self) -> bool:
        return self.reset_route is not None and self._reset(self.reset_route)

    def _reset(self, route: str) -> bool:
        try:
            if route != "llama.cpp slots":
                method, path = route.split()
                return self.get_json(method, path)[0] == 200
            status, slots = self.get_json("GET", "/slots")
            if status != 200 or not isinstance(slots, list) or not slots:
                return False
            return all(self.get_json("POST", f"/slots/{int(s.get('id', i))}?action=erase", {})[0] == 200
                       for i, s in enumerate(slots) if isinstance(s, dict))
        except (OSError, urllib.error.URLError, http.client.HTTPException, ValueError, TypeError):
            return False


def _read_json(response: Any) -> dict[str, Any]:
    raw = response.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        raise ValueError(f"reply over {MAX_BODY} bytes")
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, found {type(data).__name__}")
    return data


def _events(response: Any) -> list[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to ``[DONE]``; an error event raises."""
    payloads, size = [], 0
    for line in response:
        size += len(line)
        if size > MAX_BODY:
            raise ValueError(f"stream over {MAX_BODY} bytes")
        text = line.decode("utf-8", "replace").strip()
        if not text.startswith("data:"):
            continue
        data = text[5:].strip()
        if data == "[DONE]":
            break
        payload = json.loads(data)
        if isinstance(payload, dict) and "error" in payload:
            raise ValueError(f"error event: {str(payload['error'])[:200]}")
        payloads.append(payload)
    return payloads


def _reply(payloads: list[dict[str, Any]], seconds: float) -> Reply:
    """One ``Reply`` from a whole response (one payload) or a stream's chunks (many)."""
    text, tokens, logprobs, cached, prompt_tokens = [], [], [], None, None
    for payload in payloads:
        for choice in payload.get("choices") or []:
            message = choice.get("message") or choice.get("delta") or {}
            text.append(message.get("content") or choice.get("text") or "")
            _logprobs(choice.get("logprobs"), tokens, logprobs)
        found = hit_tokens(payload)
        cached = found if found is not None else cached
        usage = payload.get("usage") or {}
        prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
    have = bool(tokens) and len(tokens) == len(logprobs)
    return Reply("".join(text), prompt_tokens, cached, tuple(tokens) if have else None,
                 tuple(logprobs) if have else None, seconds)


def _logprobs(block: Any, tokens: list[str], logprobs: list[float]) -> None:
    """Append the chosen tokens and their logprobs: chat (``content``) or completions (``token_logprobs``)."""
    if not isinstance(block, dict):
        return
    if isinstance(block.get("content"), list):
        for entry in block["content"]:
            tokens.append(str(entry.get("token")))
            logprobs.append(float(entry.get("logprob", 0.0)))
    elif isinstance(block.get("token_logprobs"), list):
        tokens.extend(str(t) for t in block.get("tokens") or [])
        logprobs.extend(float(v or 0.0) for v in block["token_logprobs"])


def hit_tokens(payload: dict[str, Any]) -> int | None:
    """The prompt tokens a reply says came from the cache, from the first ``HIT_FIELDS`` entry present."""
    for path in HIT_FIELDS:
        value: Any = payload
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
