"""Live ``kvstate serve`` instances for the server tests: uvicorn on a loopback port, in a thread."""

from __future__ import annotations

import contextlib
import http.client
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import openai
import torch

from kvstate.serve import Server, Settings, create_app
from kvstate.serve.chat import FALLBACK_STOP


@contextlib.contextmanager
def uvicorn_app(app: Any) -> Iterator[str]:
    """Serve the ASGI ``app`` on a free loopback port (uvicorn in a thread); yields the base URL."""
    import uvicorn

    runner = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not runner.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = runner.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        runner.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def live(server: Server) -> Iterator[str]:
    """Serve ``server`` on a free loopback port; yields the base URL (``http://127.0.0.1:PORT``)."""
    try:
        with uvicorn_app(create_app(server)) as url:
            yield url
    finally:
        server.close()


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` in Prometheus ``text`` whose labels include ``labels`` (parsed with
    prometheus_client's own parser, as a scraper reads it)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def make_server(model: Any, tokenizer: Any, name: str = "tiny:llama", **settings: Any) -> Server:
    """A server whose canonical chunks are 8 tokens, so the short chats of the tests hit the pool."""
    return Server(model, tokenizer, name, Settings(**{"canonical_chunk": 8, **settings}))


def reference(model: Any, tokenizer: Any, ids: list[int], max_new_tokens: int,
              stop: tuple[str, ...] = FALLBACK_STOP, **processing: Any) -> str:
    """The greedy answer plain ``model.generate`` gives on ``ids`` (with ``processing`` options such as
    ``sequence_bias``), cut at ``stop`` by this test's own rule (what any server must answer, cold or
    warm: an oracle independent of kvstate)."""
    options: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": False, **processing}
    if stop:  # what generate(stop_strings=stop) builds, built once per tokenizer (1-3 s for a 262k vocabulary)
        options["stopping_criteria"] = [*options.get("stopping_criteria", ()), _stop_criterion(tokenizer, stop)]
    history = torch.tensor([ids])
    new = model.generate(history, attention_mask=torch.ones_like(history), **options)[:, history.shape[1]:]
    text = tokenizer.decode(new[0].tolist(), skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(cuts)] if cuts else text


_CRITERIA: dict[tuple[int, tuple[str, ...]], tuple[Any, Any]] = {}


def _stop_criterion(tokenizer: Any, stop: tuple[str, ...]) -> Any:
    """transformers' ``StopStringCriteria`` for ``stop`` (stateless between calls), kept with its tokenizer."""
    from transformers import StopStringCriteria

    key = (id(tokenizer), tuple(stop))
    if key not in _CRITERIA:
        _CRITERIA[key] = (tokenizer, StopStringCriteria(tokenizer, list(stop)))
    return _CRITERIA[key][1]


def chat_turn(api: openai.OpenAI, messages: list[dict[str, str]], *, stream: bool, max_tokens: int = 10,
              model: str = "tiny:llama", **extra: Any) -> tuple[str, int]:
    """One greedy chat turn: ``(answer, cached_tokens)``."""
    if not stream:
        r = api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                        **extra)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens
    parts, cached = [], None
    for chunk in api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True}, **extra):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    assert cached is not None, "the stream ended without its usage chunk"
    return "".join(parts), cached


def await_health(proc: subprocess.Popen, port: int, name: str, seconds: float = 120.0,
                 log: Callable[[], str] | None = None) -> dict[str, Any]:
    """``GET /health`` on a loopback ``port`` until it answers 200; its JSON. ``proc`` (the server, or the
    proxy in front of it) exiting first fails with ``log()``, by default its stderr."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited: {log() if log else proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            response = conn.getresponse()
            if response.status == 200:
                return json.loads(response.read())
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{name} did not answer /health in {seconds:.0f} s")
