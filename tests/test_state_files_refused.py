"""State files refused: a well-formed file must also *mean* something on the model, and every misuse of the
file verbs is a typed error.

* Meaning: each case saves a real state from a tiny model, rewrites one tensor or header field (with
  fresh checksums, so only the meaning is wrong), and loads it. Every case raises a typed kvstate
  error; the file is not touched, and a live session on the same model keeps its state bitwise.
  Saving K/V that a lossy format cannot hold is refused before anything is written.
* Misuse: ``Session.load`` / ``save`` / ``load_state`` / ``save_state`` given something that is not a
  path, a model, a state, a floating dtype or a device this machine has raise a typed error that
  names the fix, and leave the file and the state as they were.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvstate import Session, load_state, save_state
from kvstate.errors import (
    DeviceUnavailableError,
    DtypeMismatchError,
    InputError,
    KVStateError,
    LayoutMismatchError,
    StateFileError,
)
from kvstate.io import container, state_to_bytes
from tiny import assert_same_state, prompt, snapshot, tiny_model

VOCAB = 128


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The model, a live session on it, and one saved file per storage kind."""
    model = tiny_model("llama")
    saved = Session(model)
    saved.extend(prompt(10))
    folder = tmp_path_factory.mktemp("meaning")
    paths = {}
    for storage in ("exact", "int8", "float16", "bfloat16"):
        paths[storage] = folder / f"{storage}.kvs"
        saved.save(paths[storage], compact=None if storage == "exact" else storage)
    live = Session(model)
    live.extend(prompt(6, seed=9))
    return model, live, paths


def forge(source, target, edit) -> None:
    """Rewrite ``source`` into ``target`` after ``edit(header, tensors)``; checksums are recomputed."""
    header, tensors = container.read(source)
    header = {k: v for k, v in header.items() if k not in ("checksum", "checksums", "header_crc")}
    tensors = {name: t.clone() for name, t in tensors.items()}
    edit(header, tensors)
    container.write(target, tensors, header)


def put(name, make):
    """An edit replacing tensor ``name`` with ``make(old)``."""
    def edit(header, tensors):
        tensors[name] = make(tensors[name])
    return edit


def every_kv(make):
    def edit(header, tensors):
        for name in [n for n in tensors if n.endswith((".keys", ".values"))]:
            tensors[name] = make(tensors[name])
    return edit


def header_field(key, make):
    def edit(header, tensors):
        header[key] = make(header[key])
    return edit


def poke(value, where=(0, 0, 0, 0)):
    def make(t):
        t = t.clone()
        t[where] = value
        return t
    return make


def tokens_with(value):
    def make(rows):
        return [[value, *row[1:]] for row in rows]
    return make


def both(*edits):
    def edit(header, tensors):
        for e in edits:
            e(header, tensors)
    return edit


# name: (storage of the source file, edit, error)
CASES = {
    "last_logits 5 wide for a 128-token vocabulary": ("exact", put("last_logits", lambda t: t[:, :5]),
                                                      LayoutMismatchError),
    "last_logits wider than the vocabulary": ("exact", put("last_logits", lambda t: torch.cat([t, t[:, :3]], 1)),
                                              LayoutMismatchError),
    "last_logits as ints": ("exact", put("last_logits", lambda t: t.long()), StateFileError),
    "one K/V head fewer": ("exact", both(put("layers.1.keys", lambda t: t[:, :1]),
                                         put("layers.1.values", lambda t: t[:, :1])), LayoutMismatchError),
    "keys narrower than the head dim": ("exact", put("layers.0.keys", lambda t: t[..., :4]), LayoutMismatchError),
    "values wider than the head dim": ("exact", put("layers.2.values", lambda t: torch.cat([t, t], -1)),
                                       LayoutMismatchError),
    "K/V stored as float64 under a float32 header": ("exact", every_kv(lambda t: t.double()), StateFileError),
    "one layer in bfloat16 among float32": ("exact", put("layers.3.values", lambda t: t.bfloat16()),
                                            StateFileError),
    "a float64 state for a float32 model": ("exact", both(every_kv(lambda t: t.double()),
                                                          header_field("kv_dtype", lambda _: "float64")),
                                            DtypeMismatchError),
    "a bfloat16 state for a float32 model": ("exact", both(every_kv(lambda t: t.bfloat16()),
                                                           header_field("kv_dtype", lambda _: "bfloat16")),
                                             DtypeMismatchError),
    "a token id past the vocabulary": ("exact", header_field("tokens", tokens_with(VOCAB + 5)), LayoutMismatchError),
    "a negative token id": ("exact", header_field("tokens", tokens_with(-1)), LayoutMismatchError),
    "int8: an infinite scale": ("int8", put("layers.0.keys.scale", poke(float("inf"))), StateFileError),
    "int8: a NaN scale": ("int8", put("layers.1.values.scale", poke(float("nan"))), StateFileError),
    "int8: a zero scale": ("int8", put("layers.0.keys.scale", poke(0.0)), StateFileError),
    "int8: a negative scale": ("int8", put("layers.0.keys.scale", poke(-1.0)), StateFileError),
    "int8: one scale broadcast over every channel": ("int8", put("layers.0.keys.scale", lambda t: t.flatten()[:1]),
                                                     StateFileError),
    "int8: scales in float16": ("int8", put("layers.0.keys.scale", lambda t: t.half()), StateFileError),
    "int8: payload stored as float32": ("int8", put("layers.0.keys", lambda t: t.float()), StateFileError),
    "float16: an infinite key": ("float16", put("layers.0.keys", poke(float("inf"))), StateFileError),
    "float16: a NaN value": ("float16", put("layers.2.values", poke(float("nan"))), StateFileError),
    "bfloat16: a -inf key": ("bfloat16", put("layers.3.keys", poke(float("-inf"))), StateFileError),
    "bfloat16: payload stored as float32": ("bfloat16", put("layers.0.values", lambda t: t.float()),
                                            StateFileError),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_file_that_does_not_fit_the_model_is_refused(name, files, tmp_path):
    model, live, paths = files
    storage, edit, error = CASES[name]
    path = tmp_path / "forged.kvs"
    forge(paths[storage], path, edit)
    data, before = path.read_bytes(), snapshot(live.state)
    with pytest.raises(error) as info:
        Session.load(path, model)
    assert isinstance(info.value, KVStateError)
    assert "found:" in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert path.read_bytes() == data
    assert_same_state(live.state, before)


def test_the_forging_itself_keeps_a_file_loadable(files, tmp_path):
    """Control: forging with no edit loads, so each case above fails for its edit alone."""
    model, _, paths = files
    for storage, source in paths.items():
        forge(source, tmp_path / f"{storage}.kvs", lambda header, tensors: None)
        loaded = Session.load(tmp_path / f"{storage}.kvs", model)
        assert loaded.state.tokens_seen == 10, storage


def test_dtype_refusal_names_both_dtypes_and_the_cast(files, tmp_path):
    model, _, paths = files
    forge(paths["exact"], tmp_path / "bf16.kvs", CASES["a bfloat16 state for a float32 model"][1])
    with pytest.raises(DtypeMismatchError) as info:
        Session.load(tmp_path / "bf16.kvs", model)
    text = str(info.value)
    assert "bfloat16" in text and "float32" in text and "cast_dtype=True" in text, text
    cast = Session.load(tmp_path / "bf16.kvs", model, cast_dtype=True)  # the opt-in the message names
    assert cast.state.kv_dtype == torch.float32 and cast.state.metadata["kvstate.cast"] == "bfloat16 -> float32"


def with_keys(state, value):
    """``state`` with one key of its first layer set to ``value``."""
    layer = state.layers[0]
    parts = dict(layer.tensors())
    keys = parts["keys"].clone()
    keys[0, 0, 0, 0] = value
    layers = (type(layer).from_parts(layer.meta(), {**parts, "keys": keys}), *state.layers[1:])
    return replace(state, layers=layers)


SAVE_CASES = {
    "int8 of an infinite key": (float("inf"), "int8"),
    "int8 of a NaN key": (float("nan"), "int8"),
    "float16 of an infinite key": (float("-inf"), "float16"),
    "float16 of a key past its range": (1e6, "float16"),
    "bfloat16 of a NaN key": (float("nan"), "bfloat16"),
}


@pytest.mark.parametrize("name", sorted(SAVE_CASES))
def test_lossy_save_of_non_finite_kv_is_refused_before_writing(name, files, tmp_path):
    model, _, paths = files
    value, compact = SAVE_CASES[name]
    session = Session(model, state=with_keys(load_state(paths["exact"]), value))
    before, original = state_to_bytes(session.state), session.state  # bytes: NaN != NaN under torch.equal
    target = tmp_path / "kept.kvs"
    target.write_bytes(paths["exact"].read_bytes())
    with pytest.raises(StateFileError) as info:
        session.save(target, compact=compact)
    assert "compact=None" in str(info.value)
    with pytest.raises(StateFileError):
        save_state(session.state, tmp_path / "new.kvs", compact=compact)
    assert target.read_bytes() == paths["exact"].read_bytes()
    assert not (tmp_path / "new.kvs").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["kept.kvs"]
    assert session.state is original and state_to_bytes(session.state) == before


def test_exact_storage_keeps_what_it_is_given(files, tmp_path):
    """Exact storage promises the state's own values, finite or not: it round-trips them bitwise."""
    _, _, paths = files
    state = with_keys(load_state(paths["exact"]), float("inf"))
    save_state(state, tmp_path / "inf.kvs")
    assert_same_state(load_state(tmp_path / "inf.kvs"), state)


@pytest.mark.parametrize("edit", ["heads", "head dim"])
def test_a_checkpoint_whose_kv_does_not_fit_is_refused(edit, tmp_path):
    """Checkpoints hold K/V too (falcon_h1's hybrid layers): a rollback must never restore foreign ones."""
    model = tiny_model("falcon_h1")
    saved = Session(model, checkpoint_every=4)
    saved.extend(prompt(10))
    assert any("keys" in layer.tensors() for c in saved.state.checkpoints for layer in c.layers.values())
    saved.save(tmp_path / "s.kvs")
    cut = (lambda t: t[:, :1]) if edit == "heads" else (lambda t: t[..., :2])
    forge(tmp_path / "s.kvs", tmp_path / "forged.kvs", both(put("checkpoints.0.layers.0.keys", cut),
                                                            put("checkpoints.0.layers.0.values", cut)))
    with pytest.raises(LayoutMismatchError, match="checkpoint 0 layer 0"):
        Session.load(tmp_path / "forged.kvs", model)
    assert Session.load(tmp_path / "s.kvs", model).state.tokens_seen == 10  # control: the unforged file loads


@pytest.fixture(scope="module")
def session():
    """A live session with 8 tokens processed, saved afresh by each misuse case."""
    s = Session(tiny_model("llama"))
    s.extend(prompt(8))
    return s


FILE_CASES = {
    "Session.load(path, object())": (lambda s, path: Session.load(path, object()), InputError),
    "Session.load(path, None)": (lambda s, path: Session.load(path, None), InputError),
    "Session.load(None, model)": (lambda s, path: Session.load(None, s.model), StateFileError),
    "Session.load(3, model)": (lambda s, path: Session.load(3, s.model), StateFileError),
    "save(None)": (lambda s, path: s.save(None), StateFileError),
    "save(path, metadata=[1])": (lambda s, path: s.save(path, metadata=[1]), StateFileError),
}


@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_file_misuse_raises_a_typed_error_and_leaves_the_file(name, session, tmp_path):
    call, error = FILE_CASES[name]
    path = tmp_path / "s.kvs"
    session.save(path)
    data, before = path.read_bytes(), snapshot(session.state)
    with pytest.raises(error) as info:
        call(session, path)
    assert isinstance(info.value, KVStateError) and "fix:" in str(info.value)
    assert path.read_bytes() == data and sorted(p.name for p in tmp_path.iterdir()) == ["s.kvs"]
    assert_same_state(session.state, before)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    session = Session(tiny_model("llama"))
    session.extend(prompt(6))
    path = tmp_path_factory.mktemp("files") / "a.kvs"
    session.save(path)
    return path


@pytest.mark.parametrize("dtype", ["bfloat16", torch.int8, torch.int64])
def test_load_state_takes_only_a_floating_dtype(saved, dtype):
    with pytest.raises(InputError, match="floating torch dtype"):
        load_state(saved, dtype=dtype)


def test_load_state_takes_only_a_device_this_machine_has(saved):
    with pytest.raises(InputError, match="map_location must be a device"):
        load_state(saved, map_location="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailableError):
            load_state(saved, map_location="cuda")
    assert load_state(saved, map_location="cpu", dtype=torch.bfloat16).kv_dtype == torch.bfloat16


def test_only_a_state_can_be_saved(tmp_path):
    with pytest.raises(InputError, match="only a kvstate State"):
        save_state(None, tmp_path / "n.kvs")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_session_load_takes_a_bool_cast_dtype(saved):
    with pytest.raises(InputError, match="cast_dtype must be True or False"):
        Session.load(saved, tiny_model("llama"), cast_dtype="yes")
