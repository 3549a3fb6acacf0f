"""Issue 11, acceptance 1: hostile state files raise ``StateFileError`` fast, with bounded memory.

Each file is loaded (and inspected) in a fresh interpreter that reports how long the
refusal took and how far its peak memory rose: under 1 s and under 2x the file's real
size plus 200 MB. The bounds are loose on purpose (a refusal takes milliseconds); what
they catch is a loader that allocates or reads on trust (the old loader took 13.7 s and
3.3 GB on a 6.8 KB file, and blocked forever on a FIFO).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from kvstate import Session
from kvstate.io import container
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
