"""A local bf16 checkpoint runs in its own precision, and dtype and device are explicit.

A tiny llama saved in bfloat16 (with a character tokenizer) loads in bfloat16 with ``--dtype auto`` in
``verify``, ``generate`` and ``serve``; ``--device cpu`` works; ``--device cuda`` on a machine without CUDA
is one line and exit 2. A float32 state file is refused by a bfloat16 model, and loads when the cast is asked.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from tests.redis_server import free_port
from tests.serving import await_health, chat_turn, client, reference

import children
import kvstate.models
from kvstate import Session, load_state
from kvstate.cli import main
from kvstate.errors import DeviceUnavailableError, DtypeMismatchError, InputError
from kvstate.serve.chat import Renderer
from kvstate.serve.cli import load
from kvstate.testing.tiny_tokenizer import tiny_tokenizer
from tiny import tiny_model

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """A local checkpoint as the Hub ships them: bfloat16 weights, ``config.json`` saying so, a tokenizer."""
    folder = tmp_path_factory.mktemp("ckpt") / "bf16"
    tiny_model("llama").to(torch.bfloat16).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    return folder


def _config_variant(folder, tmp_path, how):
    """A copy whose config names its dtype as older transformers wrote it, or not at all."""
    copy = tmp_path / how
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    value = config.pop("dtype")
    if how == "torch_dtype":
        config["torch_dtype"] = value
    (copy / "config.json").write_text(json.dumps(config))
    return copy


# spec (a folder variant or a built-in), requested dtype, requested device -> the dtype the model must have
LOADS = {
    "folder, auto: config.dtype": ("dtype", "auto", "cpu", torch.bfloat16),
    "folder, auto: config.torch_dtype": ("torch_dtype", "auto", "cpu", torch.bfloat16),
    "folder, auto: no dtype in config, the weights decide": ("none", "auto", "auto", torch.bfloat16),
    "folder, float32 on request": ("dtype", "float32", "cpu", torch.float32),
    "folder, float16 on request": ("dtype", "float16", "cpu", torch.float16),
    "tiny, auto: float32": ("tiny:llama", "auto", "auto", torch.float32),
    "tiny, bfloat16 on request": ("tiny:llama", torch.bfloat16, "cpu", torch.bfloat16),
}


@pytest.mark.parametrize("case", LOADS)
def test_the_loader_resolves_dtype_and_device(case, bf16, tmp_path):
    spec, dtype, device, expected = LOADS[case]
    folder = not spec.startswith("tiny:")
    if folder:
        spec = str(bf16 if spec == "dtype" else _config_variant(bf16, tmp_path, spec))
    model, _ = kvstate.models.load_model(spec, dtype=dtype, device=device, progress=False)
    weights = {p.dtype for p in model.parameters()}
    assert weights == {expected}, f"{case}: {weights}"
    on_gpu = folder and device == "auto" and not NO_CUDA  # auto: CUDA where available, for a folder only
    assert {p.device.type for p in model.parameters()} == {"cuda" if on_gpu else "cpu"}


REFUSED = {
    "an unknown dtype": (dict(dtype="int8"), InputError, "int8"),
    "an unknown device": (dict(device="tpu"), InputError, "tpu"),
    "cuda without CUDA": (dict(device="cuda"), DeviceUnavailableError, "'cuda' is not available"),
    "a second GPU on a machine without one": (dict(device="cuda:1"), DeviceUnavailableError, "cuda:1"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_an_impossible_request_is_refused_before_any_weights_load(case, tmp_path):
    if NO_CUDA is False and "cuda" in case:
        pytest.skip("this machine has CUDA")
    kwargs, error, shown = REFUSED[case]
    with pytest.raises(error) as info:  # the folder does not exist: only a check made first can answer
        kvstate.models.load_model(str(tmp_path / "never-read"), **kwargs)
    assert shown in str(info.value) and "fix:" in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize(("requested", "runs_in"), [("auto", "bfloat16"), ("float32", "float32")])
def test_verify_runs_a_bf16_folder_in_the_dtype_asked(requested, runs_in, bf16, capsys):
    code = main(["verify", "--model", str(bf16), "--dtype", requested, "--device", "cpu", "--new-tokens", "2",
                 "--json"])
    report = json.loads(capsys.readouterr().out)["reports"][0]
    assert code in (0, 1) and (report["dtype"], report["device"]) == (runs_in, "cpu")
    other = next(r for r in report["rows"] if r["name"] == "kvstate: another process")
    assert other["error"] is None, other  # the child loaded the spec in the parent's dtype: its state file fitted


def test_prefill_and_generate_keep_the_checkpoint_dtype(bf16, tmp_path, capsys):
    (tmp_path / "doc.txt").write_text("The lighthouse keeper climbed the stairs.")
    state, after = tmp_path / "doc.kvs", tmp_path / "after.kvs"
    assert main(["prefill", "--model", str(bf16), "--prompt-file", str(tmp_path / "doc.txt"), "--out", str(state),
                 "--device", "cpu"]) == 0
    assert main(["inspect", str(state), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["kv_dtype"], info["model"]["dtype"], info["device"]) == ("bfloat16", "bfloat16", "cpu")
    assert main(["generate", "--model", str(bf16), "--state", str(state), "--prompt", " He", "--max-new-tokens",
                 "3", "--save", str(after)]) == 0
    assert "reused" in capsys.readouterr().err
    saved = load_state(after)
    assert (saved.kv_dtype, saved.fingerprint.dtype) == (torch.bfloat16, "bfloat16")


def test_a_float32_state_is_refused_by_a_bf16_model_unless_cast(bf16, tmp_path, capsys):
    (tmp_path / "doc.txt").write_text("The lighthouse keeper climbed the stairs.")
    state = tmp_path / "fp32.kvs"
    assert main(["prefill", "--model", str(bf16), "--dtype", "float32", "--prompt-file", str(tmp_path / "doc.txt"),
                 "--out", str(state)]) == 0
    assert load_state(state).kv_dtype == torch.float32
    capsys.readouterr()
    argv = ["generate", "--model", str(bf16), "--state", str(state), "--prompt", " He", "--max-new-tokens", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' weight-loading bar
    assert err.startswith("kvstate: error: DtypeMismatchError"), err
    assert "float32" in err and "bfloat16" in err and "--cast-state" in err and "cast_dtype=True" in err
    assert main([*argv, "--cast-state", "--save", str(tmp_path / "cast.kvs")]) == 0
    cast = load_state(tmp_path / "cast.kvs")
    assert cast.kv_dtype == torch.bfloat16 and cast.metadata["kvstate.cast"] == "float32 -> bfloat16"


def test_the_library_cast_is_explicit_and_recorded(bf16, tmp_path):
    wide, tokenizer = kvstate.models.load_model(str(bf16), dtype="float32", device="cpu")
    session = Session(wide, tokenizer=tokenizer)
    session.extend(tokenizer("A short note.", return_tensors="pt").input_ids)
    session.save(tmp_path / "fp32.kvs")
    narrow, _ = kvstate.models.load_model(str(bf16))
    with pytest.raises(DtypeMismatchError, match="made in float32 and the model runs in bfloat16"):
        Session.load(tmp_path / "fp32.kvs", narrow)
    loaded = Session.load(tmp_path / "fp32.kvs", narrow, cast_dtype=True)
    assert loaded.state.kv_dtype == torch.bfloat16 and loaded.state.metadata["kvstate.cast"] == "float32 -> bfloat16"
    assert load_state(tmp_path / "fp32.kvs", dtype=torch.bfloat16).kv_dtype == torch.bfloat16


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["verify", "prefill", "generate", "serve"])
def test_cuda_on_a_machine_without_it_is_one_line_and_exit_2(command, bf16, tmp_path, capsys):
    (tmp_path / "doc.txt").write_text("text")
    extra = {"verify": [], "prefill": ["--prompt-file", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "o.kvs")],
             "generate": ["--store", str(tmp_path / "store"), "--prompt", "hi"], "serve": ["--port", "1"]}[command]
    assert main([command, "--model", str(bf16), "--device", "cuda", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "DeviceUnavailableError" in err and "'cuda' is not available" in err, err
    assert "--device cpu" in err


def test_serve_runs_a_bf16_folder_in_bf16(bf16):
    port = free_port()
    proc = children.kvstate("serve", "--model", str(bf16), "--dtype", "auto", "--device", "cpu", "--port", str(port),
                            "--log-level", "warning", env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        health = await_health(proc, port, "kvstate serve")
        assert (health["dtype"], health["device"]) == ("bfloat16", "cpu")
        model, tokenizer = load(str(bf16), dtype="auto", device="cpu")  # what the server's loader gives
        assert model.dtype == torch.bfloat16
        messages = [{"role": "user", "content": "Hello in bf16"}]
        answer, _ = chat_turn(client(f"http://127.0.0.1:{port}"), messages, stream=False, model=health["model"])
        assert answer == reference(model, tokenizer, Renderer(tokenizer).chat(messages).ids, 10)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
