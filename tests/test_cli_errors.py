"""Issue 11, acceptance 5: every CLI mistake is one line, ``kvstate: error: ...``, and exit code 2.

Also: the store reuses what it stores, and continuing a saved document with text gives
the fresh run's answer (the real Gemma model, so these two are marked slow).
"""

from __future__ import annotations

import pytest
import torch

import kvstate.models
from kvstate import Session
from kvstate.cli import main
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
    (tmp_path / "folder").mkdir()
    return tmp_path


def mistakes(t) -> dict[str, list[str]]:
    closed = f"redis://127.0.0.1:{free_port()}/0"
    return {
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


def test_every_mistake_is_one_line_and_exit_2(files, capsys, monkeypatch):
    real = kvstate.models.load_model

    def only_tiny(spec, *args, **kwargs):  # the default model is never needed to report these
        if spec == "default":
            raise AssertionError("the default model was loaded before the mistake was reported")
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(kvstate.models, "load_model", only_tiny)
    for name, argv in mistakes(files).items():
        code = None
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
        out = capsys.readouterr()
        lines = [line for line in out.err.splitlines() if line.strip()]
        assert code == 2, f"{name}: exit {code}, stderr {out.err[-500:]}"
        assert len(lines) == 1 and lines[0].startswith("kvstate: error:"), f"{name}: {out.err[-800:]}"
        assert "Traceback" not in out.err


def test_debug_shows_the_traceback(files):
    with pytest.raises(Exception, match="no model folder"):
        main(["--debug", "verify", "--model", str(files / "no-such-model")])


@pytest.mark.slow
def test_continuing_a_saved_document_with_text_equals_a_fresh_run(tmp_path, capsys):
    from kvstate.testing import load_default_model

    model, tokenizer = load_default_model(progress=False)
    doc_text, more = "The three primary colours of light are red, green and blue. The colour of grass", "y fields is"
    (tmp_path / "doc.txt").write_text(doc_text)
    assert main(["prefill", "--prompt-file", str(tmp_path / "doc.txt"), "--out", str(tmp_path / "doc.kvs")]) == 0
    capsys.readouterr()
    assert main(["generate", "--state", str(tmp_path / "doc.kvs"), "--prompt", more, "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    ids = tokenizer(doc_text + more, return_tensors="pt").input_ids
    fresh = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(fresh[0, ids.shape[1]:], skip_special_tokens=True)
    assert printed.strip() == expected.strip()
    # "grass" + "y" is one token in the fresh run: appending "y" on its own would have changed the answer
    alone = tokenizer(more, add_special_tokens=False).input_ids
    assert tokenizer(doc_text, return_tensors="pt").input_ids.shape[1] + len(alone) != ids.shape[1]
