"""``kvstate verify`` and the CLI: real runs on tiny models, and a planted fault."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from kvstate.cli import main
from kvstate.verify import TOLERANCE, Report, compare, verify
from tiny import prompt, tiny_model

CHECKS = {"kvstate: generate(full history)", "kvstate: fully processed history", "kvstate: reset after other chat",
          "kvstate: fork", "kvstate: truncate", "kvstate: chunked prefill", "kvstate: manual decode loop"}


@pytest.mark.parametrize("arch", ["gemma3_text"])  # every family's rows: test_verify_matrix.py (this is the CLI's JSON)
def test_verify_json_all_rows_pass(arch, capsys):
    assert main(["verify", "--model", f"tiny:{arch}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["reports"][0]
    rows = [row for row in report["rows"] if row["group"] == "kvstate"]
    assert report["ok"] is True and {row["name"] for row in rows} >= CHECKS
    for row in rows:
        assert row["verdict"] == "pass" and row["relative"] <= TOLERANCE
        assert row["greedy_agree"] == row["greedy_total"] == 16


def test_table_output(capsys):
    assert main(["verify", "--model", "tiny:qwen3", "--new-tokens", "4", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "kvstate: truncate" in out and "all kvstate paths match" in out and "4/4" in out


def test_planted_fault_fails_the_row():
    model = tiny_model("llama")
    report = verify(model, prompt(20), new_tokens=4)
    assert report.ok
    row = report.rows[0]
    good = torch.randn(1, 128)
    corrupted = good.clone()
    corrupted[0, 3] += 0.5  # one wrong logit
    bad = compare("corrupt", "kvstate", "planted", corrupted, torch.zeros(1, 4), good, torch.zeros(1, 4))
    assert not bad.matches and bad.relative > TOLERANCE and bad.verdict == "FAIL"
    drift = compare("drift", "plain", "planted", good, torch.tensor([[0, 0, 1, 0]]), good, torch.zeros(1, 4))
    assert not drift.matches and drift.greedy_agree == 2 and drift.verdict == "drifts"
    failing = Report("m", "sdpa", 20, 4, [row, bad])
    assert not failing.ok and "FAIL" in failing.table() and "MISMATCH" in failing.table()


def test_list_and_unknown_model(capsys):
    assert main(["verify", "--list"]) == 0
    assert "gemma3_text" in capsys.readouterr().out.split()
    assert main(["verify", "--model", "tiny:no_such_model_type"]) == 2
    assert "UnsupportedModelError" in capsys.readouterr().err


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "kvstate.cli", "verify", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--model" in out and "tiny:<model_type>" in out and "examples:" in out
