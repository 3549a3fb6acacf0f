"""`kvstate inspect`, `prefill` and `generate`: the state file in the shell workflow.

A file is inspected as JSON (against ``docs/inspect.schema.json``) and as a table; a corrupt one exits 2.
On the real Gemma model (marked slow): ``generate`` continues a prefilled file from its last cut, a store
reuses a prompt on the second run, and a saved document continued with text gives the fresh run's answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from kvstate import Session, load_state
from kvstate.cli import main
from tiny import WINDOW, prompt, tiny_model

SCHEMA = json.loads((Path(__file__).parent.parent / "docs" / "inspect.schema.json").read_text())


@pytest.fixture
def state_file(tmp_path):
    s = Session(tiny_model("gemma3_text"), sliding_reserve=3, canonical_chunk=0)
    s.extend(prompt(3 * WINDOW))
    s.extend(prompt(2, seed=1))  # sliding layers keep window - 1, the reserve and these 2 (the last append)
    path = tmp_path / "s.kvs"
    s.save(path, metadata={"who": "test"})
    return path, s.state


def test_inspect_json_matches_state_and_schema(state_file, capsys):
    path, state = state_file
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    jsonschema.validate(info, SCHEMA)
    assert info["tokens_seen"] == state.tokens_seen and info["batch_size"] == 1
    assert info["model"] == state.fingerprint.to_dict() and info["metadata"] == {"who": "test"}
    assert info["file_bytes"] == path.stat().st_size
    for got, layer in zip(info["layers"], state.layers, strict=True):
        assert (got["kind"], got["tokens_seen"], got["slots"], got["window"]) == (
            layer.kind, layer.tokens_seen, layer.slots, layer.meta()["window"])
        assert got["positions"] == [int(layer.positions.min()), int(layer.positions.max())]
        assert got["bytes"] == layer.keys.nbytes + layer.values.nbytes


def test_inspect_table(state_file, capsys):
    path, state = state_file
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gemma3_text" in out and f"{state.tokens_seen} seen" in out and "sliding_attention" in out
    assert f"{3 * WINDOW + 2 - (WINDOW - 1 + 3 + 2)}..{3 * WINDOW + 1}" in out  # retained window positions


def test_inspect_corrupt_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.kvs"
    bad.write_bytes(b"not a state file at all")
    assert main(["inspect", str(bad)]) == 2
    assert "StateFileError" in capsys.readouterr().err


@pytest.mark.slow
def test_prefill_then_generate_on_default_model(tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("Alice has three apples and Bob has two. Together they have")
    out = tmp_path / "doc.kvs"
    assert main(["prefill", "--prompt-file", str(doc), "--out", str(out), "--canonical-chunk", "4"]) == 0
    saved = load_state(out)
    assert saved.tokens_seen > 5 and saved.fingerprint.tokenizer_hash is not None
    assert main(["generate", "--state", str(out), "--prompt", " exactly", "--max-new-tokens", "4",
                 "--save", str(tmp_path / "after.kvs")]) == 0
    err = capsys.readouterr().err
    # generate continues with the file's chunk of 4: it restarts at the last multiple of 4 the file holds
    reused = saved.tokens_seen // 4 * 4
    assert f"reused {reused} tokens" in err and f"fed {saved.tokens_seen + 1 - reused}" in err
    # the prompt token and all 4 answer tokens: the last one is processed too, so the file holds the whole turn
    assert load_state(tmp_path / "after.kvs").tokens_seen == saved.tokens_seen + 1 + 4


@pytest.mark.slow
def test_generate_with_store_reuses_the_prompt_on_the_second_run(tmp_path, capsys):
    text = " ".join(f"Rule {i}: visitors sign in at the front desk before noon." for i in range(12))
    store = str(tmp_path / "store")
    assert main(["generate", "--store", store, "--prompt", text, "--max-new-tokens", "3"]) == 0
    first = capsys.readouterr()
    assert "reused 0 tokens" in first.err
    assert main(["generate", "--store", store, "--prompt", text + " Rule 12:", "--max-new-tokens", "3"]) == 0
    second = capsys.readouterr()
    assert "reused 128 tokens" in second.err  # two full 64-token chunks from the first run
    assert main(["generate", "--store", store, "--prompt", text, "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "reused 128 tokens" in err  # the same prompt again: every aligned chunk of it (the rest is fed)
    assert main(["store", "stats", "--store", store, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hits"] == 2


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
