"""Inputs a new user got wrong and kvstate accepted or answered with a raw exception (a held-out probe): each is now
a typed error that names the fix, raised before anything changes."""

from __future__ import annotations

import pytest
import torch

from kvstate import Session, load_state, save_state
from kvstate.cli import main
from kvstate.errors import DeviceUnavailableError, InputError
from tiny import prompt, tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    session = Session(tiny_model("llama"))
    session.extend(prompt(6))
    path = tmp_path_factory.mktemp("files") / "a.kvs"
    session.save(path)
    return path


def test_a_store_given_as_a_string_is_refused_at_construction(tmp_path):
    with pytest.raises(InputError, match="prefix caches") as info:
        Session(tiny_model("llama"), store=str(tmp_path / "st"))
    assert "PrefixStore(" in str(info.value)  # the fix names the class to wrap it in
    with pytest.raises(InputError, match="prefix caches"):
        Session(tiny_model("llama"), sources=[object()])


@pytest.mark.parametrize("call", ["generate", "extend"])
def test_a_batch_of_no_rows_is_refused(call):
    session = Session(tiny_model("llama"))
    ids = torch.zeros(0, 5, dtype=torch.long)
    with pytest.raises(InputError, match="no row"):
        session.generate(ids, max_new_tokens=2) if call == "generate" else session.extend(ids)
    assert session.state.is_empty


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


def test_session_load_takes_a_bool_cast_dtype(saved):
    with pytest.raises(InputError, match="cast_dtype must be True or False"):
        Session.load(saved, tiny_model("llama"), cast_dtype="yes")


@pytest.mark.parametrize("setting, least", [("canonical_chunk", "canonical_chunk=0 (off) or more"),
                                            ("max_checkpoints", "max_checkpoints=0 (off) or more"),
                                            ("chunk_size", "chunk_size=1 or more")])
def test_a_setting_below_its_least_value_names_that_value_in_the_fix(setting, least):
    """0 is a valid canonical chunk (the schedule off): the fix must not ask for 1 or more."""
    with pytest.raises(InputError) as info:
        Session(tiny_model("llama"), **{setting: -1})
    assert info.value.fix == f"pass {least}", info.value.fix
