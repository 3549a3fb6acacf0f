"""Prefix store: sharing across processes, worker migration, isolation, stress and crashes.

Redis tests start a real ``redis-server`` (Debian's package, installed by .ci/run) on loopback.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

import children
from kvstate import PrefixStore, Session
from kvstate.io import state_from_bytes, state_to_bytes
from kvstate.protocols import PrefixQuery
from kvstate.testing.tiny import image_span, tiny_image
from redis_server import redis_server
from tiny import prompt, tiny_model

CHUNK = 16  # store entries and canonical chunks alike: every entry ends on a cut of the canonical schedule


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as (url, _):
        yield url


@pytest.fixture(params=["folder", "redis"])
def location(request, tmp_path):
    if request.param == "folder":
        return str(tmp_path / "store")
    url = request.getfixturevalue("redis_url")
    import redis

    redis.Redis.from_url(url).flushdb()
    return url


WORKER = r"""
import json, sys, torch
from kvstate import PrefixStore, Session
from kvstate.testing.tiny import tiny_model
location, arch, ids = sys.argv[1], sys.argv[2], torch.tensor(json.loads(sys.argv[3]))
session = Session(tiny_model(arch), store=PrefixStore(location, chunk_tokens=16), canonical_chunk=16)
out = session.generate(ids, torch.ones_like(ids), max_new_tokens=6, do_sample=False)  # replies may hold pad id 0
print(json.dumps({"tokens": out.tolist(), "reused": session.last_plan.reused}))
"""


def worker(location: str, arch: str, ids: torch.Tensor) -> dict:
    import json

    done = children.run(WORKER, location, arch, json.dumps(ids.tolist()))  # another process
    return json.loads(done.stdout.strip().splitlines()[-1])


def fresh_run(arch: str, ids: torch.Tensor) -> list:
    model = tiny_model(arch)
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                          do_sample=False)[:, ids.shape[1]:].tolist()


# backend and family are independent (the store moves bytes; the family decides what a state holds), so one
# pair each: a recurrent family with checkpoints on a folder, a sliding one on Redis. The second process is another
# worker continuing the conversation (the first's reply, then a new turn) on its own model instance.
@pytest.mark.parametrize(("location", "arch"), [("folder", "lfm2"), ("redis", "gemma3_text")], indirect=["location"])
def test_two_processes_share_a_store_and_a_conversation_migrates(location, arch):
    ids = prompt(40)
    first = worker(location, arch, ids)
    assert first["reused"] == 0
    longer = torch.cat([ids, torch.tensor(first["tokens"]), prompt(7, seed=5)], 1)
    second = worker(location, arch, longer)
    assert second["reused"] >= 32  # at least two full chunks from the first process
    assert second["tokens"] == fresh_run(arch, longer)


def test_isolation_by_model_namespace_and_image(tmp_path):
    ids = prompt(40)
    store = PrefixStore(tmp_path / "s", chunk_tokens=CHUNK)
    a = Session(tiny_model("llama", seed=0), store=store, canonical_chunk=CHUNK)
    b = Session(tiny_model("llama", seed=1), store=store, canonical_chunk=CHUNK)
    assert store.keys(a.fingerprint, ids, (), False) != store.keys(b.fingerprint, ids, (), False)
    a.generate(ids, max_new_tokens=2, do_sample=False)
    tokens = b.generate(torch.cat([ids, prompt(3, seed=2)], 1), max_new_tokens=4, do_sample=False)
    assert b.last_plan.reused == 0  # never served the other model's state
    assert tokens.tolist() == tiny_model("llama", seed=1).generate(
        torch.cat([ids, prompt(3, seed=2)], 1), max_new_tokens=4, do_sample=False)[:, 43:].tolist()
    other_ns = Session(tiny_model("llama", seed=0), canonical_chunk=CHUNK,
                       store=PrefixStore(tmp_path / "s", chunk_tokens=CHUNK, namespace="tenant-b"))
    other_ns.generate(torch.cat([ids, prompt(3, seed=2)], 1), max_new_tokens=2, do_sample=False)
    assert other_ns.last_plan.reused == 0
    vl = Session(tiny_model("qwen3_vl"), store=store, canonical_chunk=CHUNK)
    pix1, grid, n = tiny_image((4, 6), seed=1)
    pix2, _, _ = tiny_image((4, 6), seed=2)
    history = torch.cat([prompt(4), image_span(n), prompt(30, seed=3)], 1)
    media1 = vl._binding.inputs.hashes(history, {"pixel_values": pix1, "image_grid_thw": grid})
    media2 = vl._binding.inputs.hashes(history, {"pixel_values": pix2, "image_grid_thw": grid})
    assert store.keys(vl.fingerprint, history, tuple(media1), False) != \
        store.keys(vl.fingerprint, history, tuple(media2), False)
    vl.generate(history, max_new_tokens=2, do_sample=False, pixel_values=pix1, image_grid_thw=grid)
    again = Session(tiny_model("qwen3_vl"), store=store, canonical_chunk=CHUNK)
    again.generate(torch.cat([history, prompt(2, seed=4)], 1), max_new_tokens=2, do_sample=False,
                   pixel_values=pix2, image_grid_thw=grid)
    assert again.last_plan.reused == 0  # same ids, other pixels: not the same prefix


def test_compressed_states_are_stored_apart(tmp_path):
    from kvstate.compress import KNorm

    store = PrefixStore(tmp_path / "s", chunk_tokens=CHUNK, write="all")
    s = Session(tiny_model("llama"), store=store, canonical_chunk=CHUNK)
    ids = prompt(33)
    s.extend(ids)
    plain_keys = store.keys(s.fingerprint, ids, (), False)
    s.compress(KNorm(0.5))
    query = PrefixQuery(s.fingerprint, ids)
    assert store.offer([s.state], query) == 0  # a compressed state cannot be truncated to chunk boundaries
    assert store.keys(s.fingerprint, ids, (), True)[0] != plain_keys[0]


STRESS = r"""
import random, sys
import torch
from kvstate import PrefixStore, State
from kvstate.layers import AttentionLayerState
from kvstate.io import state_from_bytes, state_to_bytes
location, seed, capacity = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = PrefixStore(location, capacity_bytes=capacity)

def state_for(k):
    g = torch.Generator().manual_seed(k)
    n = 8 + k % 24
    layer = AttentionLayerState(torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g),
                                torch.arange(n)[None], n)
    return State(tokens=torch.full((1, n), k), mask=torch.ones(1, n, dtype=torch.bool),
                 positions=torch.arange(n)[None], layers=(layer,), next_position=torch.tensor([n]))

rng = random.Random(seed)
misses = 0
for _ in range(400):
    k = rng.randrange(40)
    op = rng.random()
    if op < 0.5:
        store.backend.put(f"k{k:04d}", state_to_bytes(state_for(k)), capacity)
    elif op < 0.95:
        data = store.backend.get(f"k{k:04d}")
        if data is None:
            misses += 1
            continue
        state = state_from_bytes(data)
        assert torch.equal(state.tokens, state_for(k).tokens), "an entry holds another key's state"
        assert torch.equal(state.layers[0].keys, state_for(k).layers[0].keys)
    else:
        store.prune(capacity)
print("ok", misses)
"""


def test_stress_concurrent_processes(location):
    """Four processes (more than the cores, so they interleave) of 400 random puts, gets and prunes each on
    one store at its capacity: no entry ever holds another key's state, and the capacity holds. (Eight of
    200 each did the same operations and spent most of their time importing torch.)"""
    capacity = 200_000
    procs = [children.spawn(STRESS, location, str(seed), str(capacity)) for seed in range(4)]  # forked: no imports
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0 and out.startswith("ok"), err[-2000:]
    stats = PrefixStore(location).stats()
    assert stats["bytes"] <= capacity and stats["entries"] > 0 and stats["evictions"] > 0


def test_writer_killed_mid_write_leaves_nothing_wrong(tmp_path):
    from test_state_files_hostile import synthetic_state

    store = PrefixStore(tmp_path / "s")
    states = {k: synthetic_state(400 + 10 * k, k) for k in range(6)}
    blobs = {k: state_to_bytes(s) for k, s in states.items()}
    rng = random.Random(7)
    for _ in range(20):
        pid = os.fork()
        if pid == 0:
            try:
                while True:
                    for k, blob in blobs.items():
                        store.backend.put(f"k{k}", blob, None)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0, 0.03))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        for key, _, _ in store.backend.entries():
            state = state_from_bytes(store.backend.get(key))  # every visible entry is whole and right
            assert torch.equal(state.tokens, states[int(key[1:])].tokens)


def test_cli_store_commands(tmp_path, capsys):
    from kvstate.cli import main

    location = str(tmp_path / "s")
    writer = Session(tiny_model("llama"), canonical_chunk=CHUNK,
                     store=PrefixStore(location, chunk_tokens=CHUNK, write="all"))
    writer.generate(prompt(50), max_new_tokens=2, do_sample=False)
    assert main(["store", "stats", "--store", location, "--json"]) == 0
    import json

    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 3 and stats["writes"] == 3 and stats["misses"] == 1
    assert main(["store", "ls", "--store", location]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 3
    assert main(["store", "prune", "--store", location, "--max-bytes", "1"]) == 0
    assert "evicted 3 entries" in capsys.readouterr().out


def test_turns_serve_the_same_prompt_and_a_longer_one(tmp_path):
    """An aligned prompt is stored at its full length (for longer requests, and with its canonical last
    logits for the same request again: nothing to feed) and one chunk shorter."""
    model = tiny_model("llama")
    store = PrefixStore(tmp_path / "s", chunk_tokens=CHUNK)
    ids = prompt(2 * CHUNK)
    Session(model, store=store, canonical_chunk=CHUNK).generate(ids, max_new_tokens=1)
    again = Session(model, store=store, canonical_chunk=CHUNK)
    again.generate(ids, max_new_tokens=1)
    assert (again.last_plan.source, again.last_plan.reused, again.last_plan.fed) == ("store", 2 * CHUNK, 0)
    longer = Session(model, store=store, canonical_chunk=CHUNK)
    more = torch.cat([ids, prompt(5, seed=3)], 1)
    tokens = longer.generate(more, max_new_tokens=3, do_sample=False)
    assert (longer.last_plan.source, longer.last_plan.reused) == ("store", 2 * CHUNK)
    assert torch.equal(tokens, model.generate(more, attention_mask=torch.ones_like(more), max_new_tokens=3,
                                              do_sample=False)[:, more.shape[1]:])
