"""The self-check's verdict cache cannot be forged and follows in-place changes.

The model is a tiny gpt_neox (no registered adapter: it earns the structural one through the
self-check). Its verdict, ``exact``, is cached; then it is made non-causal in place (each
attention's ``is_causal`` set to False, the issue's reproduction), and an attacker edits the
cache folder. Every row must end with the probe run again and the model refused; the one
control row (a verdict signed with a secret the attacker could not have read) is trusted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

import pytest
import torch

from kvstate.errors import UnsupportedModelError
from kvstate.selfcheck import adapter_for
from kvstate.testing.shrink import tiny_causal_lm
from tiny import count_forwards

EXACT = {"mode": "exact", "rollback": True, "reason": None, "seconds": 0.0}


def non_causal(model):
    for module in model.modules():
        if hasattr(module, "is_causal"):
            module.is_causal = False
    return model


def entries(folder):
    return {p.name: p for p in folder.glob("*.json")}


def signed(secret: bytes, key: str, verdict: dict) -> str:
    """An entry as someone holding ``secret`` would write it (the format verdict_cache documents)."""
    mac = hmac.new(secret, json.dumps({"key": key, "verdict": verdict}, sort_keys=True).encode(), hashlib.sha256)
    return json.dumps({"key": key, "verdict": verdict, "hmac": mac.hexdigest()})


def forge_plain(folder, causal, refused):
    refused.write_text(json.dumps(EXACT))  # the forged file


def tamper_verdict(folder, causal, refused):
    entry = json.loads(refused.read_text())
    entry["verdict"] = dict(EXACT)
    refused.write_text(json.dumps(entry))


def tamper_hmac(folder, causal, refused):
    entry = json.loads(refused.read_text())
    refused.write_text(signed(os.urandom(32), entry["key"], EXACT))


def move_entry(folder, causal, refused):
    refused.write_bytes(causal.read_bytes())  # a genuine entry, for the model before the change


def readable_secret(folder, causal, refused):
    (folder / ".secret").chmod(0o644)
    refused.write_text(signed((folder / ".secret").read_bytes(), json.loads(refused.read_text())["key"], EXACT))


def foreign_secret(folder, causal, refused):
    os.chown(folder / ".secret", 65534, 65534)
    refused.write_text(signed((folder / ".secret").read_bytes(), json.loads(refused.read_text())["key"], EXACT))


def private_secret(folder, causal, refused):  # the control: whoever holds the 0600 secret is trusted
    refused.write_text(signed((folder / ".secret").read_bytes(), json.loads(refused.read_text())["key"], EXACT))


CASES = {  # attack -> (the verdict is trusted, the cache stays usable afterwards)
    "made non-causal in place after its verdict was cached": (None, False, True),
    "forged {'mode': 'exact'} file": (forge_plain, False, True),
    "verdict edited, HMAC kept": (tamper_verdict, False, True),
    "HMAC from another secret": (tamper_hmac, False, True),
    "the causal model's genuine entry moved over": (move_entry, False, True),
    "secret readable by others (0644), entry signed with it": (readable_secret, False, False),
    "secret owned by another user, entry signed with it": (foreign_secret, False, False),
    "control: entry signed with the private secret": (private_secret, True, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_forged_or_stale_verdict_is_not_trusted(case, tmp_path, monkeypatch):
    attack, trusted, usable = CASES[case]
    if attack is foreign_secret and os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    monkeypatch.setenv("KVSTATE_SELFCHECK_CACHE", str(tmp_path))
    model = tiny_causal_lm("gpt_neox")
    assert adapter_for(model).caps.name == "structural:gpt_neox"  # probed: exact, cached
    causal = entries(tmp_path)
    non_causal(model)
    if attack is not None:
        with pytest.raises(UnsupportedModelError, match="not causal"):
            adapter_for(model)  # probed again: the module state is part of the key
        refused = next(p for name, p in entries(tmp_path).items() if name not in causal)
        attack(tmp_path, next(iter(causal.values())), refused)
    secret = (tmp_path / ".secret").read_bytes()
    with count_forwards(model) as calls:
        if trusted:
            adapter_for(model)
        else:
            with pytest.raises(UnsupportedModelError, match="not causal"):
                adapter_for(model)
    assert (calls[0] > 2) != trusted, calls[0]  # the probe ran again (a cached verdict costs 1 or 2 forwards)
    assert (tmp_path / ".secret").read_bytes() == secret  # never replaced, even when refused
    if trusted:
        return
    with count_forwards(model) as again, pytest.raises(UnsupportedModelError, match="not causal"):
        adapter_for(model)
    assert (again[0] <= 1) == usable, again[0]  # rewritten and signed: one layout forward, no probe


def test_a_weight_edited_in_place_is_probed_again(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTATE_SELFCHECK_CACHE", str(tmp_path))
    model = tiny_causal_lm("gpt_neox")
    adapter_for(model)
    with count_forwards(model) as cached:
        adapter_for(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # bumps the version counter; the fingerprint is recomputed
    with count_forwards(model) as edited:
        adapter_for(model)
    assert cached[0] == 2 and edited[0] > 5 and len(entries(tmp_path)) == 2


def test_the_secret_is_private_and_made_once(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTATE_SELFCHECK_CACHE", str(tmp_path / "cache"))
    adapter_for(tiny_causal_lm("gpt_neox"))
    info = (tmp_path / "cache" / ".secret").stat()
    assert oct(info.st_mode & 0o777) == "0o600" and info.st_uid == os.getuid() and info.st_size == 32
    assert oct((tmp_path / "cache").stat().st_mode & 0o777) == "0o700"
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.endswith(".tmp")] == []
