"""``kvstate serve`` as users start it: the command line, a real process restart, the default model."""

from __future__ import annotations

import http.client
import json
import os
import socket
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


def test_a_server_restarted_after_a_reply_reuses_as_much_as_one_that_never_stopped(tmp_path):
    """The reply's settle (the answer recomputed in canonical chunks up to where the next turn starts) reaches the
    store: settled while the model idles, or by the drain when SIGTERM comes first. So the next turn, sent to a
    restarted server, reuses as many tokens as it does on a server that never stopped (whose pool holds the
    settled state), and answers the same."""
    model, tokenizer = load("tiny:llama")
    renderer = Renderer(tokenizer)
    first = [{"role": "user", "content": "Hello, server process!"}]

    def start(store: str) -> tuple[children.Child, object]:
        port = free_port()
        proc = _start(port, store, "--store-chunk-tokens", "1")  # every cut of the schedule can be stored
        await_health(proc, port, "kvstate serve")
        return proc, client(f"http://127.0.0.1:{port}")

    proc, api = start(str(tmp_path / "never-stopped"))
    try:  # one server, two turns: the second resumes from the pool's settled state
        answer, _ = chat_turn(api, first, stream=False)
        second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "Still there?"}]
        kept_answer, kept = chat_turn(api, second, stream=False)
    finally:
        _stop(proc)
    restarted = str(tmp_path / "restarted")
    proc, api = start(restarted)
    try:
        assert chat_turn(api, first, stream=False)[0] == answer
        proc.terminate()  # at once: the reply's settle still waits for an idle model, or has just run
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-2000:]
    finally:
        _stop(proc)
    proc, api = start(restarted)
    try:
        again, reused = chat_turn(api, second, stream=False)
    finally:
        _stop(proc)
    assert again == kept_answer == reference(model, tokenizer, renderer.chat(second).ids, 10)
    assert reused == kept > len(renderer.chat(first).ids), (reused, kept)


def _stop(proc: children.Child) -> None:
    """SIGTERM, and wait for the exit (SIGKILL after a minute): the zygote reaps every child it forked."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _events(response: http.client.HTTPResponse) -> Iterator[str]:
    """The data of each server-sent event of ``response``, as they arrive."""
    for line in response:
        if line.startswith(b"data: "):
            yield line[6:].decode().strip()


@pytest.mark.parametrize("extra", [(), ("--max-batch", "4")], ids=["one-at-a-time", "batched"])
def test_sigterm_drains_a_stream_in_flight_and_exits_0_with_its_state_stored(tmp_path, extra):
    """SIGTERM is a graceful stop, as docs/serve.md's Stopping says: the listener closes (a new connection is
    refused) and so does an idle keep-alive connection, without a response; a request already on its way (its
    headers in, its body not) gets a 503 with ``Connection: close``; a stream in flight goes on until
    ``--shutdown-timeout`` and then ends with a finish chunk and ``[DONE]``; the process exits 0, and what the
    request computed is in the store for the next process."""
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
        idle = _idle_keep_alive(port)
        on_its_way = _headers_only(port, {"model": "tiny:llama", "prompt": "Hi", "max_tokens": 2})
        proc.terminate()
        signalled = time.monotonic()
        idle.settimeout(5)
        assert idle.recv(1) == b"", "an idle keep-alive connection is closed at the signal, without a response"
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
        status, headers, body = _finish(*on_its_way)
        assert status == 503 and body["error"]["code"] == "server_shutting_down", body
        assert headers.get("retry-after") == "5" and headers.get("connection") == "close", headers
        rest = list(events)
        ended = time.monotonic() - signalled
        assert proc.wait(timeout=30) == 0, proc.stderr.read()[-2000:]
    finally:
        proc.kill()
        proc.wait(timeout=30)  # reaped before its folder goes (the zygote writes its status there)
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


def _idle_keep_alive(port: int) -> socket.socket:
    """A connection that asked ``GET /health``, read the whole answer and stays open (HTTP/1.1 keep-alive)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    status, _, _ = _response(sock)
    assert status == 200
    return sock


def _headers_only(port: int, body: dict) -> tuple[socket.socket, bytes]:
    """A POST whose headers the server has read and whose body has not arrived yet; the body to send later."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n")
    time.sleep(0.3)  # the server parses the headers (the request exists) and waits for the body
    return sock, data


def _finish(sock: socket.socket, data: bytes) -> tuple[int, dict[str, str], dict]:
    """Send the rest of a request; its status, headers and JSON body, once the server closed the connection."""
    sock.sendall(data)
    status, headers, body = _response(sock)
    assert sock.recv(1) == b"", "the connection stays open after a response marked Connection: close"
    return status, headers, json.loads(body)


def _response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length, read from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b"\0"
        assert not data.endswith(b"\0"), f"the connection closed mid-response: {data!r}"
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


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
