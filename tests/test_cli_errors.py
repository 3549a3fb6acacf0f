"""Every CLI mistake is one line, ``kvstate: error: ...``, and exit code 2; ``--verbose`` prints what was
expected and found (the traceback of an unexpected error) on lines of their own.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

import kvstate.io
import kvstate.models
from kvstate import Session
from kvstate.cli import main
from kvstate.models.tiny_tokenizer import tiny_tokenizer
from redis_server import free_port
from tiny import prompt, tiny_model


@pytest.fixture
def files(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The lighthouse keeper climbed the stairs.")
    s = Session(tiny_model("llama"))
    s.extend(prompt(6))
    s.save(tmp_path / "s.kvs")
    (tmp_path / "text.kvs").write_text("this is a text file renamed to look like a state\n" * 5)
    tiny_model("llama").save_pretrained(tmp_path / "no-tokenizer")  # config and weights, no tokenizer
    tiny_model("llama").save_pretrained(tmp_path / "llama")  # a model folder the text commands can load
    tiny_tokenizer().save_pretrained(tmp_path / "llama")
    other = Session(tiny_model("qwen2"))
    other.extend(prompt(6))
    other.save(tmp_path / "qwen2.kvs")
    data = (tmp_path / "s.kvs").read_bytes()
    (tmp_path / "truncated.kvs").write_bytes(data[:len(data) // 2])
    (tmp_path / "folder").mkdir()
    return tmp_path


@pytest.fixture
def busy_port():
    with socket.socket() as listener:  # another process's server on the port
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def mistakes(t, busy_port: int) -> dict[str, list[str]]:
    closed = f"redis://127.0.0.1:{free_port()}/0"
    llama = str(t / "llama")
    return {
        "another model's state": ["generate", "--model", llama, "--state", str(t / "qwen2.kvs"), "--prompt", "hi"],
        "a state of other weights": ["generate", "--model", llama, "--state", str(t / "s.kvs"), "--prompt", "hi",
                                     "--dtype", "bfloat16"],
        "a truncated state": ["generate", "--model", llama, "--state", str(t / "truncated.kvs"), "--prompt", "hi"],
        "inspect a truncated state": ["inspect", str(t / "truncated.kvs")],
        "inspect a missing file": ["inspect", str(t / "missing.kvs")],
        "an unknown tiny model type": ["verify", "--model", "tiny:no_such_type"],
        "a --prompt for a tiny model": ["verify", "--model", "tiny:llama", "--prompt", "hello"],
        "a folder as --prompt-file": ["verify", "--model", "tiny:llama", "--prompt-file", str(t / "folder")],
        "--new-tokens x": ["verify", "--model", "tiny:llama", "--new-tokens", "x"],
        "an unknown flag": ["verify", "--bogus"],
        "no command": [],
        "an unknown command": ["bogus"],
        "--against a malformed URL": ["verify", "--against", "not a url"],
        "--cold without --against": ["verify", "--model", "tiny:llama", "--cold", "http://127.0.0.1:1"],
        "serve on a port in use": ["serve", "--model", "tiny:llama", "--port", str(busy_port)],
        "serve with an unusable store": ["serve", "--model", "tiny:llama", "--store", "/proc/x"],
        "serve --no-reuse with --store": ["serve", "--model", "tiny:llama", "--no-reuse", "--store", str(t / "st")],
        "missing --prompt-file": ["verify", "--model", "tiny:llama", "--prompt-file", str(t / "nope.txt")],
        "nonexistent --model folder": ["verify", "--model", str(t / "no-such-model")],
        "a hub id, offline": ["verify", "--model", "someone/some-model"],
        "a folder without tokenizer": ["verify", "--model", str(t / "no-tokenizer")],
        "prefill --model tiny:llama": ["prefill", "--model", "tiny:llama", "--prompt-file", str(t / "doc.txt"),
                                       "--out", str(t / "o.kvs")],
        "--max-new-tokens 0": ["generate", "--store", str(t / "st"), "--prompt", "hi", "--max-new-tokens", "0"],
        "--save into a missing folder": ["generate", "--state", str(t / "s.kvs"), "--prompt", "hi", "--save",
                                         str(t / "missing" / "x.kvs")],
        "--out pointing at a folder": ["prefill", "--prompt-file", str(t / "doc.txt"), "--out", str(t / "folder")],
        "store stats on /proc/x": ["store", "stats", "--store", "/proc/x"],
        "store stats on a closed Redis port": ["store", "stats", "--store", closed],
        "verify --new-tokens 0": ["verify", "--model", "tiny:llama", "--new-tokens", "0"],
        "--backends bogus": ["verify", "--model", "tiny:llama", "--backends", "bogus"],
        "generate --store without a prompt": ["generate", "--store", str(t / "st")],
        "neither --state nor --store": ["generate", "--prompt", "hi"],
        "a text file renamed .kvs": ["inspect", str(t / "text.kvs")],
        "generate --state of a missing file": ["generate", "--state", str(t / "missing.kvs"), "--prompt", "hi"],
        "a corrupt state for generate": ["generate", "--state", str(t / "text.kvs"), "--prompt", "hi"],
        "prune without --max-bytes": ["store", "prune", "--store", str(t / "st")],
        "an unknown fault": ["verify", "--inject", "bogus"],
        "--dtype int8": ["verify", "--model", "tiny:llama", "--dtype", "int8"],
        "--device tpu": ["generate", "--store", str(t / "st"), "--prompt", "hi", "--device", "tpu"],
        "--cast-state without --state": ["generate", "--store", str(t / "st"), "--prompt", "hi", "--cast-state"],
        **({} if torch.cuda.is_available() else {
            "--device cuda without CUDA": ["verify", "--model", "tiny:llama", "--device", "cuda"]}),
    }


def test_every_mistake_is_one_line_and_exit_2(files, busy_port, capsys, monkeypatch):
    real = kvstate.models.load_model

    def only_tiny(spec, *args, **kwargs):  # the default model is never needed to report these
        if spec == "default":
            raise AssertionError("the default model was loaded before the mistake was reported")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(kvstate.models, "load_model", only_tiny)
    capsys.readouterr()
    for name, argv in mistakes(files, busy_port).items():
        code, err = run(argv, capsys)
        assert code == 2, f"{name}: exit {code}, stderr {err[-500:]}"
        # exactly one line: no loading bar (its carriage returns count as lines too), no traceback
        assert err.startswith("kvstate: error:") and err.count("\n") == 1 and err.endswith("\n") \
            and "\r" not in err and len(err) < 500, f"{name}: {err[-800:]}"
        assert "; fix: " in err, f"{name}: the error names no fix: {err}"


@pytest.mark.parametrize("keys, env", [(["--api-key", ""], {}), (["--api-key", "  "], {}),
                                       (["--api-key", "k1", "--api-key", ""], {}), ([], {"KVSTATE_API_KEY": ""}),
                                       ([], {"KVSTATE_API_KEY": " , "})],
                         ids=["empty", "blank", "one of two empty", "env empty", "env blank"])
def test_an_empty_api_key_is_refused_before_serving(keys, env, capsys, monkeypatch):
    """``--api-key "$KEY"`` with ``KEY`` unset must not start an open server that looks protected (a missing
    Authorization header matched the empty key)."""
    import kvstate.serve

    served = []
    monkeypatch.setattr(kvstate.serve, "run", lambda *args, **kwargs: served.append(args))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code, err = run(["serve", "--model", "tiny:llama", "--port", "0", *keys], capsys)
    assert (code, served) == (2, []), err
    assert err.startswith("kvstate: error:") and err.count("\n") == 1 and "fix: " in err and "key" in err, err


def test_serving_without_keys_off_loopback_warns(capsys, monkeypatch):
    import kvstate.serve

    monkeypatch.setattr(kvstate.serve, "run", lambda *args, **kwargs: None)
    monkeypatch.delenv("KVSTATE_API_KEY", raising=False)
    code, err = run(["serve", "--model", "tiny:llama", "--port", "0", "--host", "0.0.0.0"], capsys)
    assert code == 0 and "warning: listening on 0.0.0.0 without --api-key" in err


def test_cast_state_warns_in_one_line_that_the_cast_is_why_nothing_is_reused(files, capsys):
    """``generate --cast-state`` continues a state of another dtype; its cast slots are not what the model
    computes, so the canonical schedule feeds them again. The warning says that, on one line."""
    code, err = run(["generate", "--model", str(files / "llama"), "--state", str(files / "s.kvs"), "--prompt", " hi",
                     "--max-new-tokens", "2", "--dtype", "bfloat16", "--cast-state"], capsys)
    warnings = [line for line in err.splitlines() if "warning" in line.lower()]
    assert code == 0 and len(warnings) == 1, err
    assert warnings[0].startswith("kvstate: warning: the state was cast (float32 -> bfloat16)") \
        and "--canonical-chunk 0" in warnings[0], warnings
    assert "off the schedule" not in err  # the old text blamed a schedule the user never set


def run(argv: list[str], capsys) -> tuple[int, str]:
    """``kvstate argv`` in this process: its exit code and stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case", ["another model's state", "a truncated state", "an unknown tiny model type",
                                  "a folder as --prompt-file"])
def test_verbose_prints_what_was_expected_and_found(files, busy_port, capsys, case):
    argv = mistakes(files, busy_port)[case]
    code, short = run(argv, capsys)
    for verbose in (["--verbose", *argv], [*argv, "--verbose"]):  # before or after the command
        code_verbose, err = run(verbose, capsys)
        lines = err[err.index("kvstate: error:"):].splitlines()  # after model loading's progress bars
        assert code == code_verbose == 2, err
        assert any(line.startswith("  found: ") for line in lines), err
        assert any(line.startswith("  fix: ") for line in lines), err
        assert len(err) >= len(short)


def test_an_unexpected_error_is_one_line_with_exit_1_and_its_traceback_with_verbose(files, capsys, monkeypatch):
    def broken(path):
        raise RuntimeError("the disk is on fire\n" + "smoke " * 100)

    monkeypatch.setattr(kvstate.io, "inspect_state", broken)
    code, err = run(["inspect", str(files / "s.kvs")], capsys)
    assert code == 1 and err.count("\n") == 1 and err.startswith("kvstate: error: RuntimeError: the disk is on fire")
    assert "--verbose" in err and len(err) < 500
    code, err = run(["--verbose", "inspect", str(files / "s.kvs")], capsys)
    assert code == 1 and "Traceback (most recent call last)" in err and "smoke " * 100 in err


def test_debug_shows_the_traceback(files):
    with pytest.raises(Exception, match="no model folder"):
        main(["--debug", "verify", "--model", str(files / "no-such-model")])


def test_another_models_state_is_one_line_from_the_shell(files):
    """A real process: what a terminal shows, transformers' own output included."""
    argv = mistakes(files, 0)["another model's state"]
    done = subprocess.run([sys.executable, "-m", "kvstate.cli", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "\r" not in done.stderr, done.stderr
    assert done.stderr.startswith("kvstate: error: FingerprintMismatchError: state belongs to a different model "
                                  "(model_type, ") and "fix: load the model the state was made with" in done.stderr
