"""Two ``kvstate serve`` workers on one Redis behind nginx (``docs/deploy.md``).

A client chats 10 turns through nginx with a conversation id (affinity), streaming every other
turn and asking for logprobs; three turns carry an id that hashes to the other worker. Every
answer and its logprobs must equal one worker's alone (and plain ``model.generate``'s text), and
every turn from the second must reuse tokens, whichever worker served it.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from tests.nginx_server import nginx
from tests.redis_server import free_port, redis_server
from tests.serving import client, live, make_server, metric, reference

import children
from kvstate.serve.chat import Renderer
from kvstate.serve.cli import load

pytestmark = pytest.mark.slow
MODEL, TURNS, MAX_TOKENS = "tiny:llama", 10, 6
FORCED = {3, 6, 8}  # turns (0-based) sent with an id that hashes to the other worker


@contextlib.contextmanager
def worker(folder: Path, store: str) -> Iterator[str]:
    """A ``kvstate serve`` process as docs/deploy.md starts one; yields its ``host:port``."""
    port = free_port()
    log = (folder / f"worker-{port}.log").open("w")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = children.kvstate("serve", "--model", MODEL, "--port", str(port), "--store", store, "--canonical-chunk", "8",
                            "--store-chunk-tokens", "16", "--log-level", "warning", env=env, out=log.name, err=log.name)
    try:
        deadline = time.monotonic() + 180
        while _get(f"127.0.0.1:{port}", "/health") is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"kvstate serve did not start: {(folder / log.name).read_text()[-2000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _get(address: str, path: str) -> str | None:
    host, port = address.removeprefix("http://").split(":")
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=5)
        conn.request("GET", path)
        response = conn.getresponse()
        return response.read().decode() if response.status == 200 else None
    except OSError:
        return None


def _served(address: str) -> int:
    """Completion requests the worker has answered (its own /metrics)."""
    text = _get(address, "/metrics") or ""
    return int(sum(metric(text, "kvstate:requests_total", endpoint=route, status="200")
                   for route in ("/v1/completions", "/v1/chat/completions")))


class Workers:
    """Which worker served each request, from the workers' counters before and after it."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    @contextlib.contextmanager
    def watch(self) -> Iterator[list[str]]:
        before = [_served(a) for a in self.addresses]
        served: list[str] = []
        yield served
        served += [a for a, n in zip(self.addresses, before, strict=True) if _served(a) == n + 1]
        assert len(served) == 1, f"one request, served by {served}"


def _turn(api: openai.OpenAI, messages: list, conversation: str, stream: bool) -> tuple[str, int, list]:
    """``(answer, cached_tokens, logprobs as (token, logprob, top))`` of one greedy turn."""
    options = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                   top_logprobs=2, extra_headers={"X-Conversation-Id": conversation} if conversation else None)

    def items(logprobs) -> list:
        return [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in logprobs.content]

    if not stream:
        r = api.chat.completions.create(**options)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens, items(r.choices[0].logprobs)
    text, cached, found = "", None, []
    for chunk in api.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
        if chunk.choices and chunk.choices[0].logprobs is not None:
            text += chunk.choices[0].delta.content
            found += items(chunk.choices[0].logprobs)
    return text, cached, found


def _ids_by_worker(api: openai.OpenAI, workers: Workers) -> dict[str, str]:
    """A conversation id that nginx's hash sends to each worker, found by asking."""
    found: dict[str, str] = {}
    for i in range(64):
        with workers.watch() as served:
            api.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_headers={"X-Conversation-Id": f"c{i}"})
        found.setdefault(served[0], f"c{i}")
        if len(found) == len(workers.addresses):
            return found
    raise AssertionError(f"64 conversation ids all hashed to {list(found)}")


def _abandon_a_stream(front: str, conversation: str, address: str) -> None:
    """A client that leaves mid-stream: nginx closes its upstream connection, and the worker cancels the job
    (no completion tokens counted) and is idle again, as without nginx."""
    import json

    before = metric(_get(address, "/metrics") or "", "kvstate:generation_tokens_total")
    host, port = front.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Talk."}], "max_tokens": 2000, "stream": True,
            "temperature": 0, "stop": None, "logit_bias": {str(i): -100 for i in (0, 1, 2)}}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json",
                                                                   "X-Conversation-Id": conversation})
    response = conn.getresponse()
    assert response.status == 200 and any(b'"content"' in response.readline() for _ in range(4))
    conn.close()
    deadline = time.monotonic() + 30
    while json.loads(_get(address, "/health") or "{}").get("queue") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(_get(address, "/health") or "{}").get("queue") == 0, "the abandoned job still runs"
    assert metric(_get(address, "/metrics") or "", "kvstate:generation_tokens_total") == before, \
        "the abandoned job was completed"


def test_two_workers_behind_nginx_on_one_redis(tmp_path):
    model, tokenizer = load(MODEL)
    with redis_server(tmp_path) as (store, _), worker(tmp_path, store) as a, worker(tmp_path, store) as b, \
            nginx(tmp_path, free_port(), [a, b]) as front:
        api, workers = client(front), Workers([a, b])
        ids = _ids_by_worker(api, workers)
        home = next(iter(ids))  # the worker this conversation's id hashes to
        other = next(w for w in ids if w != home)
        log, messages = [], []
        for t in range(TURNS):
            messages.append({"role": "user", "content": f"And {t}?"})  # short: 10 turns fit the tiny context
            with workers.watch() as served:
                answer, cached, logprobs = _turn(api, messages, ids[other if t in FORCED else home], stream=t % 2 == 1)
            log.append((list(messages), answer, cached, logprobs, served[0]))
            messages.append({"role": "assistant", "content": answer})
        _abandon_a_stream(front, ids[home], home)
        round_robin = []
        for _ in range(2):  # no conversation id: nginx's round robin
            with workers.watch() as served:
                api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
            round_robin += served
    assert sorted(round_robin) == sorted([a, b]), round_robin
    assert [entry[4] for entry in log] == [other if t in FORCED else home for t in range(TURNS)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers' count: bits are promised for the same thread count (docs/exactness.md)
    try:
        _match_alone(model, tokenizer, log)
    finally:
        torch.set_num_threads(threads)


def _match_alone(model, tokenizer, log) -> None:
    with live(make_server(model, tokenizer)) as alone:  # one worker, no store: the answers to match
        for t, (history, answer, cached, logprobs, by) in enumerate(log):
            assert t == 0 or cached > 0, f"turn {t + 1} on {by}: nothing reused"
            one = _turn(client(alone), history, "", stream=False)
            assert (answer, logprobs) == (one[0], one[2]), f"turn {t + 1} on {by}"
            assert answer == reference(model, tokenizer, Renderer(tokenizer).chat(history).ids, MAX_TOKENS)
