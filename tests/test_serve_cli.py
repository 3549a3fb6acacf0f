"""``kvstate serve`` as users start it: the command line, a real process restart, the default model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
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
                   "--max-prompt-tokens", "--max-batch", "KVSTATE_API_KEY"):
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
