"""A failing prefix store never fails the call, with a folder and a real Redis; a misused one is refused.

Every fault case checks that ``generate`` returns exactly the store-less answer, and that the
failure shows: a warning, and a count in ``health()`` / ``stats()``. A full disk is
simulated by an ``OSError(ENOSPC)`` at the backend boundary (mounting a tiny
filesystem needs privileges the CI machine may not grant). A store given as a string, a
mistyped path to a read-only command and a negative prune size are refused with the fix, and
create nothing.
"""

from __future__ import annotations

import errno
import json
import warnings

import pytest
import torch

from kvstate import PrefixStore, Session
from kvstate.cli import main
from kvstate.errors import InputError, StoreError, StoreWarning
from kvstate.io import state_from_bytes
from redis_server import redis_server
from tiny import prompt, tiny_model

CHUNK = 8
N = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def answer(model, ids):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False)[:,
                                                                                                        ids.shape[1]:]


def call(model, store, ids):
    """``generate`` through the store; returns (tokens, StoreWarnings raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = Session(model, store=store).generate(ids, max_new_tokens=N, do_sample=False)
    return tokens, [w for w in caught if issubclass(w.category, StoreWarning)]


@pytest.fixture(params=["folder", "redis"])
def store_at(request, tmp_path):
    """A function making a store at a fresh location of the backend."""
    if request.param == "folder":
        yield lambda: PrefixStore(tmp_path / "store", chunk_tokens=CHUNK, write="all")
        return
    with redis_server(tmp_path) as (url, _):
        yield lambda: PrefixStore(url, chunk_tokens=CHUNK, write="all")


def test_corrupt_entries_are_misses_and_are_removed(model, store_at):
    ids = prompt(40)
    store = store_at()
    call(model, store, ids)  # fill it
    keys = [k for k, _, _ in store.backend.entries()]
    for key in keys:
        data = bytearray(store.backend.get(key))
        data[-5] ^= 0xFF  # flip a byte in the tensor data
        store.backend.put(key, bytes(data), None)
    more = torch.cat([ids, prompt(3, seed=4)], 1)
    tokens, warned = call(model, store, more)
    assert torch.equal(tokens, answer(model, more)) and warned
    for key, _, _ in store.backend.entries():  # damaged entries were removed (and good ones written again)
        state_from_bytes(store.backend.get(key))


def test_corrupt_counters_are_started_again(model, store_at, tmp_path):
    store = store_at()
    if store.backend.describe().startswith("folder"):
        (store.backend.root / "stats.json").write_text(json.dumps({"hits": [1]}))
    else:
        store.backend.client.hset(store.backend._stats, "hits", "not a number")
    ids = prompt(30)
    tokens, _ = call(model, store, ids)
    assert torch.equal(tokens, answer(model, ids))
    again, _ = call(model, store, ids)
    assert torch.equal(again, answer(model, ids))
    assert store.stats()["hits"] >= 1  # counting works again


def test_a_full_or_unwritable_store_warns_and_counts(model, store_at, monkeypatch):
    store = store_at()
    monkeypatch.setattr(store.backend, "put", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    ids = prompt(30)
    tokens, warned = call(model, store, ids)
    assert torch.equal(tokens, answer(model, ids)) and warned
    assert store.health()["failures"] == 1 and store.stats()["failures"] == 1


def test_redis_down_before_the_call(model, tmp_path):
    with redis_server(tmp_path) as (url, proc):
        store = PrefixStore(url, chunk_tokens=CHUNK)
        assert store.health()["ok"]
        proc.terminate()
        proc.wait(timeout=10)
        ids = prompt(30)
        tokens, warned = call(model, store, ids)
        assert torch.equal(tokens, answer(model, ids))
        assert len(warned) == 2  # the read and the write
        health = store.health()
        assert not health["ok"] and health["failures"] == 2 and "Connection" in health["problem"]
        with pytest.raises(StoreError, match="unreachable"):
            store.stats()


def test_redis_killed_mid_call(model, tmp_path):
    with redis_server(tmp_path) as (url, proc):
        store = PrefixStore(url, chunk_tokens=CHUNK)
        read = store.backend.get

        def read_then_die(key):
            data = read(key)
            proc.kill()  # the server dies after the lookup, before the write-back
            proc.wait(timeout=10)
            return data

        store.backend.get = read_then_die
        ids = prompt(30)
        tokens, warned = call(model, store, ids)
        assert torch.equal(tokens, answer(model, ids)) and warned
        assert store.health()["failures"] >= 1


@pytest.mark.parametrize("location", ["redis://[bad", "redis://host:notaport/0"])
def test_malformed_urls_fail_at_construction(location):
    with pytest.raises(StoreError, match="Redis URL"):
        PrefixStore(location)


@pytest.mark.parametrize("location", ["ftp://x", "s3://bucket/prefix", "http://localhost:6379/0"])
def test_other_urls_are_refused_not_made_folders(location, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the old behaviour made a folder named after the scheme here
    with pytest.raises(StoreError, match="unsupported prefix-store URL") as info:
        PrefixStore(location)
    assert location in str(info.value) and "redis://" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_an_unusable_folder_fails_at_construction(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="folder"):
        PrefixStore(tmp_path / "file")
    with pytest.raises(StoreError, match="folder"):
        PrefixStore("/proc/kvstate-store")


@pytest.mark.parametrize("replacement", ["fifo", "link to /dev/zero", "folder"])
def test_an_entry_that_is_not_a_regular_file_is_a_warned_miss(model, tmp_path, replacement):
    """A store entry replaced by a FIFO, a link to /dev/zero or a folder is read with the
    same bounded, regular-files-only reader as every CLI input: a StoreWarning and a miss, never a hang."""
    import os

    ids = prompt(40)
    store = PrefixStore(tmp_path / "store", chunk_tokens=CHUNK, write="all")
    call(model, store, ids)
    for key, _, _ in store.backend.entries():
        path = store.backend._path(key)
        path.unlink()
        {"fifo": lambda p: os.mkfifo(p), "link to /dev/zero": lambda p: os.symlink("/dev/zero", p),
         "folder": lambda p: p.mkdir()}[replacement](path)
    more = torch.cat([ids, prompt(3, seed=4)], 1)
    tokens, warned = call(model, store, more)
    assert torch.equal(tokens, answer(model, more)) and warned
    assert store.stats()["failures"] >= 1


FILE_SIZE_LIMITED = """
import json, resource, sys, warnings
import torch
from kvstate import PrefixStore, Session
from kvstate.errors import StoreWarning
from tiny import prompt, tiny_model
model, ids = tiny_model("llama"), prompt(64)
plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)[:, 64:]
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    new = Session(model, store=PrefixStore(sys.argv[1], chunk_tokens=8)).generate(ids, max_new_tokens=4,
                                                                                   do_sample=False)
print(json.dumps({"same": torch.equal(new, plain), "warned": sum(issubclass(w.category, StoreWarning)
                                                                  for w in caught)}))
"""


def test_a_write_past_the_file_size_limit_leaves_no_temporary_file(tmp_path):
    """A process under ``RLIMIT_FSIZE`` (Python ignores SIGXFSZ, so the write fails with EFBIG) answers as without
    a store and warns, and its failed write leaves no temporary file behind."""
    import children

    done = children.run(FILE_SIZE_LIMITED, str(tmp_path / "store"), "20000")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"same": True, "warned": 1}, done.stderr[-2000:]
    left = [p.name for p in (tmp_path / "store").rglob("*") if p.is_file() and p.name.endswith(".tmp")]
    assert left == [] and PrefixStore(tmp_path / "store").stats()["temp_files"] == 0


def test_a_writer_killed_mid_write_leaves_a_temporary_file_that_stats_count_and_prune_removes_once_stale(
        tmp_path):
    """A writer killed after writing its temporary file and before the rename strands it (no ``finally`` runs on
    SIGKILL): ``stats`` counts it, ``store prune`` keeps it while a live writer could still own it, and removes it
    once it is ``STALE_TEMP_SECONDS`` old."""
    import os
    import signal
    import time

    from kvstate.cli import main
    from kvstate.store.backends import STALE_TEMP_SECONDS

    location = tmp_path / "store"
    store = PrefixStore(location, chunk_tokens=CHUNK)
    pid = os.fork()
    if pid == 0:  # the real put, killed where a crash would hit it: the data written, not yet renamed
        try:
            os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
            store.backend.put("ab" + "0" * 62, b"x" * 5000, None)
        finally:
            os._exit(1)
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL
    stranded = [p for p in location.rglob("*.tmp")]
    assert len(stranded) == 1 and stranded[0].stat().st_size == 5000
    stats = store.stats()
    assert (stats["temp_files"], stats["temp_bytes"], stats["stale_temp_files"]) == (1, 5000, 0)
    assert main(["store", "prune", "--store", str(location), "--max-bytes", "0"]) == 0
    assert stranded[0].exists()  # young: it may be a live writer's
    old = time.time() - STALE_TEMP_SECONDS - 60
    os.utime(stranded[0], (old, old))
    assert store.stats()["stale_temp_files"] == 1
    assert main(["store", "prune", "--store", str(location), "--max-bytes", "0"]) == 0
    assert not stranded[0].exists() and store.stats()["temp_files"] == 0


def test_a_store_given_as_a_string_is_refused_at_construction(tmp_path):
    with pytest.raises(InputError, match="prefix caches") as info:
        Session(tiny_model("llama"), store=str(tmp_path / "st"))
    assert "PrefixStore(" in str(info.value)  # the fix names the class to wrap it in
    with pytest.raises(InputError, match="prefix caches"):
        Session(tiny_model("llama"), sources=[object()])


@pytest.mark.parametrize("action", [["stats"], ["ls"], ["health"], ["prune", "--max-bytes", "0"]])
def test_read_only_store_commands_do_not_create_a_store_at_a_mistyped_path(tmp_path, capsys, action):
    typo = tmp_path / "typo"
    assert main(["store", action[0], "--store", str(typo), *action[1:]]) == 2
    assert "no prefix store" in capsys.readouterr().err and not typo.exists()


def test_a_store_opened_without_create_must_exist(tmp_path):
    from kvstate import PrefixStore
    from kvstate.errors import StoreError

    with pytest.raises(StoreError, match="no prefix store"):
        PrefixStore(tmp_path / "typo", create=False)
    assert not (tmp_path / "typo").exists()
    PrefixStore(tmp_path / "made")
    PrefixStore(tmp_path / "made", create=False)  # the folder a store wrote


def test_prune_takes_no_negative_size(tmp_path, capsys):
    assert main(["store", "prune", "--store", str(tmp_path), "--max-bytes", "-5"]) == 2
    assert "N >= 0" in capsys.readouterr().err
