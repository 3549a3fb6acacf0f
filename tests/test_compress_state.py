"""A per-head compressed state is a state like any other: it forks, truncates, saves and loads (here and in
another process), goes through a prefix store, and really holds fewer bytes, in memory and in its file.
Refusals come before anything runs; a family without per-head masks falls back to one slot set per layer
and says so.

Continuations are compared bitwise with the same compressed state continued in this process (the oracle
for the compressed continuation itself is test_compress_heads.py).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file

import children
from kvstate import PrefixStore, Session, inspect_state, load_state
from kvstate.compress import ExpectedAttention, Keep, KNorm, KVzip
from kvstate.errors import CompressionWarning, RollbackError, StateFileError, UnsupportedError
from kvstate.io import state_from_bytes, state_to_bytes
from kvstate.protocols import PrefixQuery
from tiny import WINDOW, prompt, tiny_model

T = 3 * WINDOW


def compressed(arch: str = "gemma3_text", policy=None, **session) -> Session:
    s = Session(tiny_model(arch), **session)
    s.extend(prompt(T))
    s.compress(policy or KVzip(0.5))
    assert any(getattr(layer, "per_head", False) for layer in s.state.layers)
    return s


def test_fork_and_truncate_of_a_per_head_state_continue_bitwise():
    s = compressed()
    twin = s.fork()
    more, other = prompt(6, seed=4), prompt(3, seed=8)
    s.extend(more[:, :2])
    s.extend(more[:, 2:])
    s.truncate(T + 2)  # back inside what came after the compression
    twin.extend(more[:, :2])  # the same forwards, without the ones rolled back
    assert torch.equal(s.extend(other), twin.extend(other))
    with pytest.raises(RollbackError, match="compressed at"):
        s.truncate(T - 1)  # before the compression: the evicted slots are gone


def test_per_head_state_file_round_trips_and_frees_bytes(tmp_path):
    s = Session(tiny_model("llama"))
    s.extend(prompt(T))
    full = s.state
    full_bytes = s.save(tmp_path / "full.kvs")
    report = s.compress(KVzip(0.5))
    size = s.save(tmp_path / "c.kvs")
    state = load_state(tmp_path / "c.kvs")
    for a, b in zip(s.state.layers, state.layers, strict=True):
        assert a.meta() == b.meta() and all(torch.equal(a.tensors()[k], b.tensors()[k]) for k in a.tensors())
    more = prompt(4, seed=6)
    assert torch.equal(Session(tiny_model("llama"), state=state).extend(more), s.fork().extend(more))
    # half the bytes: the kept entries and the padding of each layer to its largest head, and nothing else
    budget = report.window_entries // 2
    assert report.entries_after == s.state.kv_entries and report.entries_after + report.padding <= budget
    assert report.kv_bytes_after == sum(layer.kv_nbytes for layer in s.state.layers) < full.kv_bytes
    for layer in s.state.layers:
        kept = layer.valid.sum(-1)  # [B, H]
        assert layer.slots == int(kept.max()) < full.layers[0].slots  # padded to the largest head only
        assert layer.keys.untyped_storage().nbytes() == layer.keys.numel() * layer.keys.element_size()  # no view
    info = inspect_state(tmp_path / "c.kvs")
    assert info["version"] == 3 and all(layer["per_head"] for layer in info["layers"])
    assert sum(layer["entries"] for layer in info["layers"]) == report.entries_after
    kv = sum(layer.kv_nbytes for layer in s.state.layers) + sum(layer.positions.numel() * 8
                                                                 for layer in s.state.layers)
    assert sum(layer["bytes"] for layer in info["layers"]) == kv  # the file holds the retained slots only
    assert size < full_bytes
    entries = Session(tiny_model("llama"))
    entries.extend(prompt(T))  # counting the kept entries alone: exactly half of them, and their padding beyond
    counted = entries.compress(KVzip(0.5, count="entries"))
    assert counted.entries_after == budget and counted.padding > 0
    even = Session(tiny_model("llama"))
    even.extend(prompt(T))  # every head of a layer keeps as many: nothing pads
    evened = even.compress(KVzip(0.5, count="bytes"))
    heads = even.model.config.num_key_value_heads
    assert budget - heads < evened.entries_after <= budget and evened.padding == 0
    for layer in even.state.layers:
        assert layer.slots == int(layer.valid.sum(-1).min())


def test_a_shared_layout_file_keeps_version_2_and_old_readers_refuse_version_3(tmp_path):
    s = Session(tiny_model("llama"))
    s.extend(prompt(T))
    shared = s.fork()
    shared.compress(KNorm(0.5))  # one slot set per layer: the layout every earlier kvstate wrote
    shared.save(tmp_path / "shared.kvs")
    assert inspect_state(tmp_path / "shared.kvs")["version"] == 2
    assert "per_head" not in load_state(tmp_path / "shared.kvs").layers[0].meta()
    s.compress(KVzip(0.5))
    data = bytearray(state_to_bytes(s.state))
    from kvstate.io import container, schema

    header, tensors = container.parse(data, "x")
    assert header["version"] == 3
    with pytest.raises(StateFileError, match="per_head and its positions disagree"):
        schema.decode({**header, "layers": [{**header["layers"][0], "per_head": None}, *header["layers"][1:]]},
                      tensors)
    bad = dict(tensors)
    positions = bad["layers.0.positions"].clone()
    positions[0, 0, -1] = -1  # padding after a slot
    bad["layers.0.positions"] = positions
    with pytest.raises(StateFileError, match="not a per-head layout"):
        schema.decode(header, bad)


CHILD = r"""
import sys, torch
from safetensors.torch import save_file
from kvstate import Session
from kvstate.testing.tiny import tiny_model, tiny_prompt
model = tiny_model(sys.argv[3])
if sys.argv[4] == "bfloat16":
    model = model.to(torch.bfloat16)
s = Session.load(sys.argv[1], model)
first = s.extend(tiny_prompt(5, seed=4))
out = [first]
for _ in range(3):
    out.append(s.extend(out[-1].argmax(-1, keepdim=True)))
save_file({"logits": torch.cat(out).contiguous()}, sys.argv[2])
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_per_head_state_continues_bitwise_in_another_process(dtype, tmp_path):
    model = tiny_model("gemma3_text")
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    s = Session(model)
    s.extend(prompt(T))
    s.compress(KVzip(0.5))
    s.save(tmp_path / "c.kvs")
    here = s.fork()
    out = [here.extend(prompt(5, seed=4))]
    for _ in range(3):
        out.append(here.extend(out[-1].argmax(-1, keepdim=True)))
    children.run(CHILD, str(tmp_path / "c.kvs"), str(tmp_path / "out.safetensors"), "gemma3_text", dtype)
    assert torch.equal(load_file(str(tmp_path / "out.safetensors"))["logits"], torch.cat(out))


def test_per_head_state_goes_through_a_prefix_store(tmp_path):
    store = PrefixStore(tmp_path / "store", chunk_tokens=8, write="all")
    s = compressed("llama", canonical_chunk=0)
    s.extend(prompt(4, seed=5))  # to an aligned length after the compression
    assert store.offer([s.state], PrefixQuery(s.fingerprint, s.state.tokens)) == 1
    key = store.keys(s.fingerprint, s.state.tokens, (), True)[-1]
    stored = state_from_bytes(store.backend.get(key))
    assert any(getattr(layer, "per_head", False) for layer in stored.layers)
    more = prompt(3, seed=9)
    assert torch.equal(Session(tiny_model("llama"), state=stored).extend(more), s.fork().extend(more))


def test_refusals_come_before_any_forward():
    from tiny import count_forwards

    vl = Session(tiny_model("qwen3_vl"))
    vl.extend(prompt(20))
    before = vl.state
    with count_forwards(vl.model) as calls, pytest.raises(UnsupportedError, match="1-D positions"):
        vl.compress(ExpectedAttention(0.5))
    assert calls[0] == 0 and vl.state is before
    with pytest.raises(UnsupportedError, match="ReRotate needs every head"):
        from kvstate.compress import ReRotate

        vl.compress(ReRotate(policy=KVzip(0.5)))
    with pytest.raises(Exception, match="sliding='context' has no meaning"):
        vl.compress(KVzip(0.5), sliding="context")


def test_a_family_without_per_head_masks_keeps_one_slot_set_per_layer_and_says_so():
    from test_compress import masked_reference
    from test_families_selfcheck import build
    from tiny import assert_logits_close

    model = build("phi3")  # a structural family: per-head masks unproven
    s = Session(model)
    ids = prompt(T)
    s.extend(ids)
    with pytest.warns(CompressionWarning, match="structural:phi3 attention cannot take per-head masks"):
        s.compress(KVzip(0.5))
    assert s.state.is_compressed and not any(getattr(layer, "per_head", False) for layer in s.state.layers)
    more = prompt(4, seed=3)
    assert_logits_close(s.extend(more), masked_reference(model, torch.cat([ids, more], 1), s.state, T), "phi3")
    other = Session(model)
    other.extend(ids)
    with warnings.catch_warnings(), pytest.raises(UnsupportedError, match="cannot take per-head masks"):
        warnings.simplefilter("error")
        other.compress(Keep({0: [[0, 1, 2], [3, 4, 5]]}))
