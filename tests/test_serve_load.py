"""``kvstate serve`` under load: concurrent clients, keys, disconnects and a full queue."""

from __future__ import annotations

import http.client
import json
import threading
import time

import openai
import pytest
from tests.serving import client, live, make_server, metric, reference

from kvstate.serve.chat import Renderer
from kvstate.serve.cli import load

CLIENTS, TURNS, MAX_TOKENS = 8, 8, 4
NO_END = {"0": -100, "1": -100, "2": -100}  # pad, bos, eos: keeps a random tiny model talking


@pytest.fixture(scope="module")
def tiny() -> tuple:
    return load("tiny:llama")


def _chat(api: openai.OpenAI, script: str, log: list, errors: list) -> None:
    """One client: ``TURNS`` turns, alternating streaming; logs ``(messages, answer, cached)`` per turn."""
    messages: list[dict[str, str]] = []
    try:
        for t in range(TURNS):
            messages.append({"role": "user", "content": f"{script}{t}"})
            if t % 2:
                chunks = api.chat.completions.create(model="tiny:llama", messages=messages, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
                parts, cached = [], None
                for c in chunks:
                    parts += [c.choices[0].delta.content or ""] if c.choices else []
                    cached = c.usage.prompt_tokens_details.cached_tokens if c.usage else cached
                answer = "".join(parts)
            else:
                r = api.chat.completions.create(model="tiny:llama", messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0)
                answer, cached = r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens
            log.append((list(messages), answer, cached))
            messages.append({"role": "assistant", "content": answer})
    except Exception as exc:  # reported by the test, with the client's script
        errors.append((script, exc))


@pytest.mark.parametrize("max_batch", [1, 8])  # one at a time, and batched
def test_eight_clients_eight_turns_two_keys(tiny, max_batch):
    model, tokenizer = tiny
    server = make_server(model, tokenizer, api_keys=("alpha", "beta"), max_batch=max_batch)
    # clients 0 and 4 send the same conversation under different keys: neither may reuse the other's turns
    scripts = ["a", "b", "c", "d", "a", "f", "g", "h"]
    logs: list[list] = [[] for _ in range(CLIENTS)]
    errors: list = []
    with live(server) as url:
        threads = [threading.Thread(target=_chat, args=(client(url, "alpha" if i < 4 else "beta"), scripts[i],
                                                        logs[i], errors)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not errors, errors[:3]
        metrics = _get(url, "/metrics")
    renderer = Renderer(tokenizer)
    shared = len(tokenizer("User: ").input_ids)  # "<bos>User: " starts every conversation of a key
    for i, log in enumerate(logs):
        assert len(log) == TURNS
        assert log[0][2] <= shared, f"client {i}: turn 1 reused another conversation's or key's state"
        for t, (messages, answer, cached) in enumerate(log):
            assert answer == reference(model, tokenizer, renderer.chat(messages).ids, MAX_TOKENS), (i, t)
            assert t == 0 or cached > 0, (i, t)
    assert metric(metrics, "kvstate:requests_total", endpoint="/v1/chat/completions", status="200") \
        == CLIENTS * TURNS
    assert metric(metrics, "kvstate:queue_depth") == 0


def _get(url: str, path: str) -> str:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", path)
    return conn.getresponse().read().decode()


def _open_stream(url: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _wait_idle(server, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while server.runner.pending and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.runner.pending == 0, "the cancelled job never stopped"


def test_disconnect_mid_stream_cancels_without_touching_state(tiny):
    model, tokenizer = tiny
    server = make_server(model, tokenizer)
    long = {"model": "tiny:llama", "messages": [{"role": "user", "content": "Talk."}], "max_tokens": 2000,
            "temperature": 0, "stream": True, "stop": None, "logit_bias": NO_END}
    with live(server) as url:
        conn, response = _open_stream(url, long)
        assert response.status == 200
        first = [response.readline() for _ in range(4)]  # the role chunk and the first text chunk
        assert any(b'"content"' in line for line in first)
        pooled = len(server.pool)
        conn.close()
        _wait_idle(server)
        assert len(server.pool) == pooled and metric(_get(url, "/metrics"), "kvstate:generation_tokens_total") == 0
        assert json.loads(_get(url, "/health"))["status"] == "ok"
        short = dict(long, stream=False, max_tokens=8)
        r = client(url).chat.completions.create(**{k: v for k, v in short.items() if k != "stream"})
        ids = Renderer(tokenizer).chat(long["messages"]).ids
        import torch

        from kvstate import Session

        expected = Session(model).generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                           sequence_bias=[[[int(k)], float(v)] for k, v in NO_END.items()])
        assert r.choices[0].message.content == tokenizer.decode(expected[0], skip_special_tokens=True)


def test_full_queue_is_429_and_server_recovers(tiny):
    model, tokenizer = tiny
    server = make_server(model, tokenizer, max_queue=1)
    long = {"model": "tiny:llama", "messages": [{"role": "user", "content": "Go."}], "max_tokens": 2000,
            "temperature": 0, "stream": True, "stop": None, "logit_bias": NO_END}
    with live(server) as url:
        conn, response = _open_stream(url, long)
        assert response.status == 200 and response.readline()
        with pytest.raises(openai.RateLimitError) as info:
            client(url).chat.completions.create(model="tiny:llama", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2)
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body["code"] == "rate_limit_exceeded"
        conn.close()
        _wait_idle(server)
        r = client(url).chat.completions.create(model="tiny:llama", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
