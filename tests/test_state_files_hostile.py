"""Hostile and interrupted state files: only ``StateFileError``, fast and small, and never a torn state.

* Hostile files: each is loaded (and inspected) in a fresh interpreter that reports how long the
  refusal took and how far its peak memory rose: under 1 s and under 2x the file's real size plus
  200 MB. The bounds are loose on purpose (a refusal takes milliseconds); what they catch is a loader
  that allocates or reads on trust (the old loader took 13.7 s and 3.3 GB on a 6.8 KB file, and
  blocked forever on a FIFO).
* Fuzzed and smuggled files: mutated bytes raise ``StateFileError`` or load unchanged, a pickle is
  never executed, and a SIGKILL during a save never leaves a torn file.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import random
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate import Session, State, StateFileError, load_state, save_state
from kvstate.io import container, schema
from kvstate.layers import AttentionLayerState
from test_state_files import assert_states_equal
from tiny import prompt, tiny_model

PROBE = r"""
import json, resource, sys, time
from kvstate import StateFileError
from kvstate.io import inspect_state, load_state
results = {}
for path in sys.argv[1:]:
    for name, call in (("load", load_state), ("inspect", inspect_state)):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        try:
            call(path)
            outcome = "loaded"
        except StateFileError as exc:
            outcome = "StateFileError: " + str(exc)[:100]
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"[:200]
        results[f"{path}:{name}"] = {"outcome": outcome, "seconds": time.perf_counter() - start,
                                     "grew_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before}
print(json.dumps(results))
"""


def valid_file(folder) -> tuple:
    s = Session(tiny_model("llama"))
    s.extend(prompt(6))
    s.save(folder / "valid.kvs")
    return container.read(folder / "valid.kvs")


def rewrite(path, entries: dict, data: bytes) -> None:
    """A file with these raw safetensors entries (kvstate header inside) and data bytes."""
    raw = json.dumps(entries).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def raw_parts(path):
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def with_kvstate_header(entries: dict, header: dict) -> dict:
    header = {k: v for k, v in header.items() if k != "header_crc"}
    header["header_crc"] = container.header_crc(header)
    return {**entries, "__metadata__": {"kvstate": json.dumps(header)}}


def hostile_files(folder) -> dict[str, object]:
    header, tensors = valid_file(folder)
    entries, data = raw_parts(folder / "valid.kvs")
    kv = json.loads(entries["__metadata__"]["kvstate"])
    files = {}

    past_end = dict(entries)
    name = next(k for k in entries if k.startswith("layers.0.keys"))
    past_end[name] = {**entries[name], "data_offsets": [0, 2**40]}
    rewrite(folder / "past_end.kvs", past_end, data)
    files["sizes past the data"] = folder / "past_end.kvs"

    bomb_tensors = dict(tensors)  # zero-width heads, 2e8 slots: no bytes, a huge count
    bomb_tensors["layers.0.keys"] = torch.empty(1, 0, 200_000_000, 8)
    bomb_tensors["layers.0.values"] = torch.empty(1, 0, 200_000_000, 8)
    bomb = json.loads(json.dumps(header))
    bomb["layers"][0].update(slots=200_000_000, tokens_seen=200_000_000, positions=[[[0, 200_000_000]]])
    bomb["checksums"] = {n: container.digest(t) for n, t in bomb_tensors.items()}
    container.write(folder / "bomb.kvs", bomb_tensors, {k: v for k, v in bomb.items() if k != "header_crc"})
    files["zero-width K/V with 2e8 slots"] = folder / "bomb.kvs"

    with open(folder / "sparse.kvs", "wb") as f:
        f.truncate(64 * 2**30)
    files["sparse 64 GiB of zeros"] = folder / "sparse.kvs"
    sparse_data = folder / "sparse_data.kvs"
    huge = dict(entries)
    for n in entries:
        if n != "__metadata__":
            huge[n] = {**entries[n], "dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
    huge[name] = {"dtype": "U8", "shape": [2**40], "data_offsets": [0, 2**40]}
    rewrite(sparse_data, huge, b"")
    with open(sparse_data, "r+b") as f:
        f.truncate(os.path.getsize(sparse_data) + 2**40)
    files["valid-looking header over 1 TiB of sparse data"] = sparse_data

    os.mkfifo(folder / "fifo.kvs")
    files["a FIFO"] = folder / "fifo.kvs"
    (folder / "folder.kvs").mkdir()
    files["a folder"] = folder / "folder.kvs"
    os.symlink("/dev/zero", folder / "zero.kvs")
    files["a symlink to /dev/zero"] = folder / "zero.kvs"

    nested = "[" * 100_000 + "]" * 100_000
    (folder / "nested.kvs").write_bytes(struct.pack("<Q", len(nested)) + nested.encode())
    files["deeply nested JSON"] = folder / "nested.kvs"
    dup = json.dumps(with_kvstate_header(entries, kv))[:-1] + ', "positions": {"dtype": "I64", "shape": [1, 6], ' \
        '"data_offsets": [0, 48]}}'
    (folder / "dup.kvs").write_bytes(struct.pack("<Q", len(dup)) + dup.encode() + data)
    files["duplicate keys"] = folder / "dup.kvs"
    nan = dict(kv)
    nan["layers"] = [dict(kv["layers"][0], positions=[[["NaN_TOKEN", 6]]]), *kv["layers"][1:]]
    text = json.dumps(with_kvstate_header(entries, nan)).replace('\\"NaN_TOKEN\\"', "NaN")
    (folder / "nan.kvs").write_bytes(struct.pack("<Q", len(text)) + text.encode() + data)
    files["NaN in positions"] = folder / "nan.kvs"
    negative = dict(kv, tokens_seen=-1)
    rewrite(folder / "negative.kvs", with_kvstate_header(entries, negative), data)
    files["negative counters"] = folder / "negative.kvs"
    return files


def test_hostile_files_are_refused_fast_and_small(tmp_path):
    files = hostile_files(tmp_path)
    done = subprocess.run([sys.executable, "-c", PROBE, *map(str, files.values())], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    for what, path in files.items():
        real = os.stat(path).st_blocks * 512 if os.path.isfile(path) else 0
        for call in ("load", "inspect"):
            r = results[f"{path}:{call}"]
            assert r["outcome"].startswith("StateFileError"), f"{what} ({call}): {r['outcome']}"
            assert r["seconds"] < 1.0, f"{what} ({call}): {r['seconds']:.2f} s"
            assert r["grew_kb"] * 1024 < 2 * real + 200 * 2**20, f"{what} ({call}): peak grew {r['grew_kb']} KB"


@pytest.mark.parametrize("name", ["bomb.kvs", "past_end.kvs"])
def test_the_messages_say_what_is_wrong(tmp_path, name):
    from kvstate import StateFileError, load_state

    hostile_files(tmp_path)
    with pytest.raises(StateFileError) as info:
        load_state(tmp_path / name)
    text = str(info.value)
    assert "expected:" in text and "found:" in text and "fix:" in text


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


# 10,000 mutated files in all: 200 examples of 50 files each, as hypothesis spends about 1.5 ms of its own on
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
    kills = 30
    for _ in range(kills):
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
    assert outcomes["old"] + outcomes["new"] == kills
    assert left >= kills // 5, "too few kills landed mid-write for the test to mean anything"
    assert outcomes["new"] >= 1
