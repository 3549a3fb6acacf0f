"""State files: lossless, portable across processes, bounded, refused when foreign."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import children
from kvstate import Session, StateFileError, inspect_state, load_state
from kvstate.errors import DtypeMismatchError, FingerprintMismatchError, LayoutMismatchError
from kvstate.testing.tiny import RECURRENT
from tiny import CONFIGS, WINDOW, prompt, tiny_model

ARCHS = sorted(CONFIGS)
N_NEW = 16


def continue_greedy(session, ids):
    out = session.generate(ids, max_new_tokens=N_NEW, do_sample=False, return_dict_in_generate=True,
                           output_logits=True)
    return out.sequences, out.logits[0]


def assert_layers_equal(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert x.meta() == y.meta()
        tx, ty = x.tensors(), y.tensors()
        assert tx.keys() == ty.keys()
        for name in tx:
            assert tx[name].dtype == ty[name].dtype and torch.equal(tx[name], ty[name]), name


def assert_states_equal(a, b):
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask)
    assert torch.equal(a.positions, b.positions) and torch.equal(a.next_position, b.next_position)
    assert (a.last_logits is None) == (b.last_logits is None)
    if a.last_logits is not None:
        assert torch.equal(a.last_logits, b.last_logits)
    assert a.fingerprint == b.fingerprint and dict(a.extras).keys() == dict(b.extras).keys()
    assert all(torch.equal(a.extras[k], b.extras[k]) for k in a.extras)
    assert_layers_equal(a.layers, b.layers)
    assert [c.tokens_seen for c in a.checkpoints] == [c.tokens_seen for c in b.checkpoints]
    for ca, cb in zip(a.checkpoints, b.checkpoints, strict=True):
        assert sorted(ca.layers) == sorted(cb.layers)
        assert_layers_equal([ca.layers[i] for i in sorted(ca.layers)], [cb.layers[i] for i in sorted(cb.layers)])


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_lossless(arch, tmp_path):
    from test_families import conversation

    s = Session(tiny_model(arch))
    ids, inputs = conversation(arch)
    s.extend(ids, **inputs)  # one checkpoint for recurrent families
    s.generate(torch.cat([ids, prompt(3 * WINDOW, seed=2)], 1), max_new_tokens=5, do_sample=False)
    assert arch not in RECURRENT or len(s.state.checkpoints) == 2
    s.save(tmp_path / "s.kvs", metadata={"conversation": "42"})
    loaded = load_state(tmp_path / "s.kvs")
    assert_states_equal(s.state, loaded)
    assert loaded.metadata == {"conversation": "42"}


CHILD = r"""
import sys, torch
from safetensors.torch import save_file
from kvstate import Session
from kvstate.testing.tiny import tiny_model, tiny_prompt
folder, archs = sys.argv[1], sys.argv[2:]
out = {}
for arch in archs:
    s = Session.load(f"{folder}/{arch}.kvs", tiny_model(arch))  # fresh instance, new process
    ids = torch.cat([s.tokens, tiny_prompt(5, seed=77)], 1)
    o = s.generate(ids, max_new_tokens=16, do_sample=False, return_dict_in_generate=True,
                   output_logits=True)
    out[f"{arch}.tokens"], out[f"{arch}.logits"] = o.sequences.contiguous(), o.logits[0].contiguous()
save_file(out, f"{folder}/child.safetensors")
"""


def test_resume_in_another_process_on_a_fresh_instance(tmp_path):
    from test_families import conversation

    expected = {}
    for arch in ARCHS:
        s = Session(tiny_model(arch))
        ids, inputs = conversation(arch)  # Qwen-VL states carry an image (and rope_deltas)
        s.extend(torch.cat([ids, prompt(3 * WINDOW - ids.shape[1] + 8, seed=3)], 1), **inputs)
        s.save(tmp_path / f"{arch}.kvs")
        ids = torch.cat([s.tokens, prompt(5, seed=77)], 1)
        expected[arch] = continue_greedy(s, ids)  # the never-saved session
    children.run(CHILD, str(tmp_path), *ARCHS)  # another process
    with safe_open(str(tmp_path / "child.safetensors"), "pt") as f:
        for arch in ARCHS:
            assert torch.equal(f.get_tensor(f"{arch}.tokens"), expected[arch][0]), arch
            assert torch.equal(f.get_tensor(f"{arch}.logits"), expected[arch][1]), arch  # bitwise


def test_sliding_file_holds_only_retained_slots(tmp_path):
    s = Session(tiny_model("gemma3_text"), sliding_reserve=4, canonical_chunk=8)  # reserve: max(4, 8 - 1)
    s.extend(prompt(10 * WINDOW))
    size = s.save(tmp_path / "s.kvs")
    header = inspect_state(tmp_path / "s.kvs")
    tensor_bytes = header["tensor_bytes"]
    assert size == (tmp_path / "s.kvs").stat().st_size
    assert size <= tensor_bytes * 1.01 + 64 * 1024
    for layer in header["layers"]:
        if layer["kind"] == "sliding_attention":
            assert layer["slots"] == WINDOW - 1 + 7 + 8  # window - 1 + reserve + the last chunk, not 10 windows
    full_kv = 2 * 1 * 2 * 10 * WINDOW * 8 * 4
    assert tensor_bytes < 2 * full_kv  # 1 full layer + 3 window-sized ones, far below 4 full layers


def test_views_of_larger_storage_are_not_written_whole(tmp_path):
    s = Session(tiny_model("gemma3_text"), sliding_reserve=0, canonical_chunk=8)
    s.extend(prompt(10 * WINDOW))
    layer = s.state.layers[0]
    assert layer.keys.untyped_storage().nbytes() > layer.keys.numel() * 4  # a view, as transformers makes
    s.save(tmp_path / "s.kvs")
    info = inspect_state(tmp_path / "s.kvs")
    assert info["layers"][0]["bytes"] == 2 * layer.keys.numel() * 4


def test_foreign_states_are_refused(tmp_path):
    s = Session(tiny_model("llama"))
    s.extend(prompt(12))
    s.save(tmp_path / "s.kvs")
    with pytest.raises(FingerprintMismatchError) as info:
        Session.load(tmp_path / "s.kvs", tiny_model("llama", seed=5))  # same config, other weights
    assert "weights_digest" in str(info.value)
    with pytest.raises((FingerprintMismatchError, LayoutMismatchError)):
        Session.load(tmp_path / "s.kvs", tiny_model("qwen3"))
    anonymous = replace(load_state(tmp_path / "s.kvs"), fingerprint=None)  # skip to the layout check
    with pytest.raises(LayoutMismatchError, match="layers"):
        Session(tiny_model("gemma3_text"), state=anonymous)


def test_dtype_cast_is_opt_in_and_recorded(tmp_path):
    s = Session(tiny_model("llama"))
    s.extend(prompt(12))
    s.save(tmp_path / "s.kvs")
    bf16 = tiny_model("llama").to(torch.bfloat16)
    with pytest.raises(DtypeMismatchError):
        Session.load(tmp_path / "s.kvs", bf16)
    cast = Session.load(tmp_path / "s.kvs", bf16, cast_dtype=True)
    assert cast.state.metadata["kvstate.cast"] == "float32 -> bfloat16"
    assert cast.state.kv_dtype == torch.bfloat16
    assert cast.extend(prompt(2, seed=3)).shape == (1, 128)


def test_map_location(tmp_path):
    s = Session(tiny_model("llama"))
    s.extend(prompt(6))
    s.save(tmp_path / "s.kvs")
    state = load_state(tmp_path / "s.kvs", map_location="meta")
    assert state.device.type == "meta" and state.layers[0].keys.device.type == "meta"


@pytest.mark.parametrize("compact,bound", [("bfloat16", 2e-2), ("float16", 2e-3), ("int8", 5e-2)])
def test_compact_storage_is_recorded_and_bounded(tmp_path, compact, bound):
    model = tiny_model("llama")
    s = Session(model)
    s.extend(prompt(30))
    exact = s.save(tmp_path / "exact.kvs")
    small = s.save(tmp_path / "small.kvs", compact=compact)
    assert small < exact
    loaded = Session.load(tmp_path / "small.kvs", model)
    assert loaded.state.metadata["kvstate.storage"] == f"{compact} (lossy)"
    assert inspect_state(tmp_path / "small.kvs")["storage"] == compact
    nxt = prompt(1, seed=4)
    ref, got = s.fork().extend(nxt), loaded.extend(nxt)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert 0 < rel < bound, rel  # lossy, but close


def test_real_safetensors_and_exact_size(tmp_path):
    s = Session(tiny_model("qwen3"))
    s.extend(prompt(9))
    size = s.save(tmp_path / "s.kvs")
    with safe_open(str(tmp_path / "s.kvs"), "pt") as f:
        meta = json.loads(f.metadata()["kvstate"])
        assert meta["format"] == "kvstate.state" and meta["version"] == 2 and meta["checksum"] == "xxh3-64"
        assert torch.equal(f.get_tensor("layers.0.keys"), s.state.layers[0].keys)
    assert size == Path(tmp_path / "s.kvs").stat().st_size


def test_wrong_version_and_garbage(tmp_path):
    from kvstate.io import container

    s = Session(tiny_model("llama"))
    s.extend(prompt(4))
    s.save(tmp_path / "s.kvs")
    header, tensors = container.read(tmp_path / "s.kvs")
    container.write(tmp_path / "v4.kvs", tensors, {**header, "version": 4})  # 3 is per-head layers' version
    with pytest.raises(StateFileError, match="version"):
        load_state(tmp_path / "v4.kvs")
    (tmp_path / "junk.kvs").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(StateFileError, match="oversized"):
        load_state(tmp_path / "junk.kvs")
    with pytest.raises(StateFileError, match="cannot open"):
        load_state(tmp_path / "missing.kvs")


def test_version_1_files_with_crc32_still_load(tmp_path):
    from kvstate.io import container

    s = Session(tiny_model("llama"))
    s.extend(prompt(6))
    s.save(tmp_path / "s.kvs")
    header, tensors = container.read(tmp_path / "s.kvs")
    old = {k: v for k, v in header.items() if k not in ("checksum", "header_crc")}
    old.update(version=1, checksums={name: container.digest(t, "crc32") for name, t in tensors.items()})
    container.write(tmp_path / "v1.kvs", tensors, old)
    assert_states_equal(load_state(tmp_path / "v1.kvs"), load_state(tmp_path / "s.kvs"))
    broken = {**old, "checksums": {**old["checksums"], "positions": "00000000"}}
    container.write(tmp_path / "bad.kvs", tensors, broken)
    with pytest.raises(StateFileError, match="checksum"):
        load_state(tmp_path / "bad.kvs")


def test_pure_ssm_state_dtype_is_checked_and_castable(tmp_path):
    s = Session(tiny_model("mamba2"))
    s.extend(prompt(10))
    s.save(tmp_path / "s.kvs")
    assert s.state.kv_dtype == torch.float32  # from the conv windows: there is no K/V
    bf16 = tiny_model("mamba2").to(torch.bfloat16)
    with pytest.raises(DtypeMismatchError):
        Session.load(tmp_path / "s.kvs", bf16)
    cast = Session.load(tmp_path / "s.kvs", bf16, cast_dtype=True)
    assert cast.state.metadata["kvstate.cast"] == "float32 -> bfloat16"
    assert cast.extend(prompt(2, seed=3)).isfinite().all()


def _large_tensors() -> dict[str, torch.Tensor]:
    """Many read pieces (``container.CHUNK``) per tensor, odd sizes, mixed dtypes, one empty."""
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 700_001, generator=g), "b": torch.randint(0, 255, (1_000_003,), dtype=torch.uint8),
            "c": torch.randn(5, 300_000, generator=g).to(torch.bfloat16), "d": torch.empty(0, 4)}


def _checked(header: dict, tensors: dict[str, torch.Tensor]) -> dict:
    from kvstate.io import container

    return {**header, "checksum": "xxh3-64", "checksums": {n: container.digest(t) for n, t in tensors.items()}}


def test_large_files_read_back_exactly_and_every_corrupt_byte_is_caught(tmp_path):
    """The one-pass load (pieces read and hashed while still in cache) and the save that hashes
    on the I/O thread while it writes: exact tensors, and a flipped byte anywhere is a typed error."""
    from kvstate.io import container

    tensors = _large_tensors()
    path = tmp_path / "big.kvs"
    size = container.write(path, tensors, {"note": "large"})  # checksums added while writing
    assert sum(t.numel() * t.element_size() for t in tensors.values()) > 8 * container.CHUNK
    header, back = container.read(path)
    assert header["note"] == "large" and back.keys() == tensors.keys()
    assert header["checksums"] == _checked({}, tensors)["checksums"]  # the digests a sequential pass gives
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    for where in (start, start + (size - start) // 3, size - (size - start) // 4, size - 1):
        bad = bytearray(data)
        bad[where] ^= 0x5A
        (tmp_path / "bad.kvs").write_bytes(bytes(bad))
        with pytest.raises(StateFileError, match="checksum"):
            container.read(tmp_path / "bad.kvs")


def test_a_forked_child_loads_large_files(tmp_path):
    """The I/O thread (a save's hashing) does not survive ``fork``: a child must start its own."""
    import multiprocessing

    from kvstate.io import container

    tensors = _large_tensors()
    container.write(tmp_path / "big.kvs", tensors, {})  # the parent's I/O thread exists before the fork
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        digests = pool.apply_async(_digests_of_loaded, (str(tmp_path / "big.kvs"),)).get(timeout=60)
    assert digests == {n: container.digest(t) for n, t in tensors.items()}


def _digests_of_loaded(path: str) -> dict[str, str]:
    """Save a copy (hashed on the child's I/O thread) and load it back. No torch kernels here:
    OpenMP's threads do not survive ``fork`` either."""
    from kvstate.io import container

    copy = path + ".copy"
    container.write(copy, container.read(path)[1], {})
    return {n: container.digest(t) for n, t in container.read(copy)[1].items()}


def test_a_failed_replace_leaves_the_old_file_and_no_leftovers(tmp_path, monkeypatch):
    """A save that fails at the rename (after the replaced file got its second name) is a typed
    error, and leaves the previous file as it was and no ``.tmp`` or ``.old`` beside it."""
    from kvstate.io import container

    tensors = _large_tensors()
    path = tmp_path / "s.kvs"
    container.write(path, tensors, {"n": 1})
    before = path.read_bytes()

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(container.os, "replace", refuse)
    with pytest.raises(StateFileError, match="cannot write"):
        container.write(path, tensors, {"n": 2})
    from kvstate.io.checksum import run_beside

    run_beside(lambda: None).result()  # kvstate's I/O thread frees replaced files: list once it is idle
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["s.kvs"]
