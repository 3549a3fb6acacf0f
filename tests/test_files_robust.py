"""Hostile and interrupted files (issue 3, points 5 and 6): only StateFileError, never a torn state."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import random
import signal
import struct
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate import Session, State, StateFileError, load_state, save_state
from kvstate.io import container, schema
from kvstate.layers import AttentionLayerState
from test_files import assert_states_equal
from tiny import prompt, tiny_model


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    s = Session(tiny_model("gemma3_text"))
    s.extend(prompt(14))
    path = tmp_path_factory.mktemp("fuzz") / "s.kvs"
    s.save(path, metadata={"k": "v"})
    return path.read_bytes(), s.state


def load_bytes(data: bytes) -> State:
    return schema.decode(*container.parse(data, "fuzz"))


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**9), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**9), st.just(0)),
    st.tuples(st.just("extend"), st.integers(1, 64), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 10**9), st.integers(0, 255)),
    st.tuples(st.just("digit"), st.integers(0, 10**9), st.integers(0, 9)),
)


def mutate(data: bytes, ops) -> bytes:
    out = bytearray(data)
    for kind, where, value in ops:
        i = where % max(len(out), 1)
        if kind == "flip" and out:
            out[i] ^= value
        elif kind == "truncate":
            del out[i:]
        elif kind == "extend":
            out += bytes([value]) * where
        elif kind == "insert":
            out[i:i] = bytes([value])
        elif kind == "digit":  # edit a number inside the JSON header: still valid JSON
            digits = [j for j in range(min(len(out), 8 + 4096)) if 48 <= out[j] <= 57]
            if digits:
                out[digits[where % len(digits)]] = 48 + value
    return bytes(out)


# 10,000 mutated files (issue 3): 200 examples of 50 files each, as hypothesis spends about 1.5 ms of its own on
# every example, eight times what loading one file takes
@settings(max_examples=200, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(batch=st.lists(st.lists(mutation, min_size=1, max_size=3), min_size=50, max_size=50))
def test_fuzzed_files_raise_state_file_error_or_load_unchanged(original, batch):
    data, state = original
    for ops in batch:
        try:
            loaded = load_bytes(mutate(data, ops))
        except StateFileError:
            continue
        assert_states_equal(loaded, state)  # a harmless edit (e.g. JSON whitespace) changed nothing


def test_seeded_byte_fuzz_covers_every_offset(original):
    data, state = original
    rng = random.Random(1234)
    for offset in range(0, len(data), max(1, len(data) // 2000)):
        corrupt = bytearray(data)
        corrupt[offset] ^= rng.randint(1, 255)
        with contextlib.suppress(StateFileError):
            assert_states_equal(load_bytes(bytes(corrupt)), state)


class Boom:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


MARKER = "/tmp/kvstate-pickle-executed"


def test_smuggled_pickle_is_rejected_and_never_executed(original, tmp_path):
    data, _ = original
    if os.path.exists(MARKER):
        os.remove(MARKER)
    payload = pickle.dumps(Boom())
    (n,) = struct.unpack("<Q", data[:8])
    entries = json.loads(data[8:8 + n])
    header = json.loads(entries["__metadata__"]["kvstate"])
    header["metadata"]["payload"] = base64.b64encode(payload).decode()  # pickle in the header
    header["extras"] = ["evil"]
    entries["__metadata__"]["kvstate"] = json.dumps(header)
    size = sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in entries.items() if k != "__metadata__")
    entries["extras.evil"] = {"dtype": "U8", "shape": [len(payload)], "data_offsets": [size, size + len(payload)]}
    raw = json.dumps(entries).encode()
    evil = tmp_path / "evil.kvs"
    evil.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:] + payload)
    with pytest.raises(StateFileError):
        load_state(evil)
    assert not os.path.exists(MARKER)
    entries["__metadata__"]["kvstate"] = "\x80\x04" + payload.decode("latin-1")  # header *is* a pickle
    raw = json.dumps(entries).encode()
    evil.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:] + payload)
    with pytest.raises(StateFileError):
        load_state(evil)
    assert not os.path.exists(MARKER)


def synthetic_state(slots: int, seed: int) -> State:
    gen = torch.Generator().manual_seed(seed)
    layers = tuple(AttentionLayerState(torch.randn(1, 2, slots, 64, generator=gen),
                                       torch.randn(1, 2, slots, 64, generator=gen),
                                       torch.arange(slots)[None], slots) for _ in range(4))
    return State(tokens=torch.randint(0, 100, (1, slots), generator=gen),
                 mask=torch.ones(1, slots, dtype=torch.bool), positions=torch.arange(slots)[None], layers=layers,
                 next_position=torch.tensor([slots]), last_logits=torch.randn(1, 50, generator=gen))


def test_sigkill_during_save_never_leaves_a_torn_file(tmp_path):
    path = tmp_path / "state.kvs"
    old, new = synthetic_state(3000, 1), synthetic_state(3100, 2)  # ~6 MB each: saves take a while
    save_state(old, path)
    rng = random.Random(99)
    outcomes = {"old": 0, "new": 0}
    left = 0
    mine = f".state.kvs.{os.getpid()}."  # this process's own, being freed on its I/O thread right now
    for _ in range(50):
        pid = os.fork()
        if pid == 0:  # child: overwrite the file with the new state, over and over
            try:
                while True:
                    save_state(new, path)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.0, 0.05))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        loaded = load_state(path)  # must load, and be exactly one of the two
        which = "old" if loaded.tokens_seen == 3000 else "new"
        assert_states_equal(loaded, old if which == "old" else new)
        outcomes[which] += 1
        # only abandoned temp files remain, and second names of replaced files whose freeing was cut short:
        # those are whole earlier states
        leftovers = [p.name for p in tmp_path.iterdir() if p.name != "state.kvs" and not p.name.startswith(mine)]
        assert all(name.startswith(f".state.kvs.{pid}.") and name.endswith((".tmp", ".old")) for name in leftovers)
        for name in (n for n in leftovers if n.endswith(".old")):
            kept = load_state(tmp_path / name)
            assert_states_equal(kept, old if kept.tokens_seen == 3000 else new)
        left += len(leftovers)
        save_state(old, path)  # reset, so the next kill races the old -> new replacement again
        # ... and that save deletes what the killed writer left: its pid is dead, the names are its own
        assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(f".state.kvs.{pid}.")]
    assert outcomes["old"] + outcomes["new"] == 50
    assert left >= 10, "too few kills landed mid-write for the test to mean anything"
    assert outcomes["new"] >= 1
