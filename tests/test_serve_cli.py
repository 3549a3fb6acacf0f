"""``kvstate serve`` as users start it: the command line, a real process restart, the default model."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
from tests.redis_server import free_port
from tests.serving import await_health, chat_turn, client, live, make_server, reference

import children
from kvstate.serve.chat import Renderer
from kvstate.serve.cli import load


def _kvstate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstate.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_names_every_option():
    out = _kvstate("serve", "--help").stdout
    for option in ("--model", "--store", "--host", "--port", "--api-key", "--max-queue", "--max-request-bytes",
                   "--max-prompt-tokens", "--max-batch", "--shutdown-timeout", "KVSTATE_API_KEY"):
        assert option in out


def test_unusable_store_fails_before_the_model_loads(tmp_path):
    (tmp_path / "file").write_text("x")
    run = _kvstate("serve", "--model", "tiny:llama", "--store", str(tmp_path / "file" / "sub"))
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "StoreError" in run.stderr


def _start(port: int, store: str, *extra: str) -> children.Child:
    """A ``kvstate serve`` process (forked from the zygote, ``tests/children.py``: a new process, without the
    imports; the tests above start the command itself)."""
    return children.kvstate("serve", "--model", "tiny:llama", "--port", str(port), "--store", store,
                            "--store-chunk-tokens", "16", "--canonical-chunk", "16", "--log-level", "warning", *extra,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))




@pytest.mark.parametrize("extra", [(), ("--max-batch", "4", "--prefill-per-step", "8")],  # batched: in pieces
                         ids=["one-at-a-time", "batched"])
def test_process_restart_on_a_folder_store_resumes_the_conversation(tmp_path, extra):
    model, tokenizer = load("tiny:llama")
    renderer, store, messages = Renderer(tokenizer), str(tmp_path / "store"), []
    for turn, text in enumerate(["Hello, server process!", "Still there after a restart?"]):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = _start(port, store, *extra)
        try:
            await_health(proc, int(url.rsplit(":", 1)[1]), "kvstate serve")
            messages.append({"role": "user", "content": text})
            answer, cached = chat_turn(client(url), messages, stream=bool(turn))
            assert answer == reference(model, tokenizer, renderer.chat(messages).ids, 10)
            assert (cached >= 16) == (turn == 1), cached  # turn 2 runs in a new process: reuse comes from the store
            messages.append({"role": "assistant", "content": answer})
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _events(response: http.client.HTTPResponse) -> Iterator[str]:
    """The data of each server-sent event of ``response``, as they arrive."""
    for line in response:
        if line.startswith(b"data: "):
            yield line[6:].decode().strip()


@pytest.mark.parametrize("extra", [(), ("--max-batch", "4")], ids=["one-at-a-time", "batched"])
def test_sigterm_drains_a_stream_in_flight_and_exits_0_with_its_state_stored(tmp_path, extra):
    """SIGTERM is a graceful stop: the listener closes (or a new request gets a 503), a stream in flight goes on
    until ``--shutdown-timeout`` and then ends with a finish chunk and ``[DONE]``, the process exits 0, and what
    the request computed is in the store for the next process."""
    from kvstate.adapters.fingerprinting import fingerprint
    from kvstate.protocols import PrefixQuery
    from kvstate.store import PrefixStore

    model, tokenizer = load("tiny:llama")
    port, store, prompt = free_port(), str(tmp_path / "store"), "A long story about the sea, told slowly: "
    proc = _start(port, store, "--shutdown-timeout", "1", *extra)
    try:
        await_health(proc, port, "kvstate serve")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "tiny:llama", "prompt": prompt, "stream": True,
                                                            "max_tokens": 2048, "temperature": 0, "stop": None}),
                     {"Content-Type": "application/json"})
        events = _events(conn.getresponse())
        chunks = [json.loads(next(events)) for _ in range(3)]  # the answer is streaming
        proc.terminate()
        signalled = time.monotonic()
        rest = list(events)
        ended = time.monotonic() - signalled
        assert _refused_or_503(port), "a draining server must not take new requests"
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
    finally:
        proc.kill()
    chunks += [json.loads(e) for e in rest[:-1]]
    assert rest[-1] == "[DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    assert 0.9 < ended < 6, f"the stream ended {ended:.2f} s after SIGTERM, --shutdown-timeout 1"
    answer = "".join(c["choices"][0]["text"] for c in chunks)
    assert 10 < len(answer) < 2048, "the answer was cut by the deadline, not by max_tokens"
    ids = tokenizer(prompt + answer).input_ids  # one token per character: the conversation as it stands
    query = PrefixQuery(fingerprint(model, tokenizer), torch.tensor([ids]))
    found = PrefixStore(store, chunk_tokens=16).lookup(query, longer_than=0, at_most=len(ids))
    # the store keeps canonical prefixes (every slot computed as a cold run would): the prompt's, here
    assert found is not None and found.tokens_seen >= len(tokenizer(prompt).input_ids) // 16 * 16, found


def _refused_or_503(port: int) -> bool:
    """Whether a new request to ``port`` is refused (closed listener) or answered 503."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/health")
        return conn.getresponse().status == 503
    except OSError:
        return True


@pytest.mark.slow
def test_default_model_two_turns():
    model, tokenizer = load("default")
    renderer, messages = Renderer(tokenizer), []
    with live(make_server(model, tokenizer, "gemma-3-270m")) as url:
        api = client(url)
        for turn, text in enumerate(["What is the capital of France?", "And of Italy?"]):
            messages.append({"role": "user", "content": text})
            answer, cached = chat_turn(api, messages, stream=bool(turn), max_tokens=8, model="gemma-3-270m")
            assert answer == reference(model, tokenizer, renderer.chat(messages).ids, 8)
            assert (cached > 0) == (turn == 1)
            messages.append({"role": "assistant", "content": answer})
    assert "Paris" in messages[1]["content"]
