"""Each broken contract raises its typed error, with expected / found / fix.

Masks, positions, batch sizes, dtypes and devices that disagree with the state, a state from
another model, a rollback past what a layer retains, a model that is not causal or still has
dropout on, empty inputs and settings below their least value: each is refused with an error from
the one ``KVStateError`` hierarchy.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kvstate
from kvstate import Session
from kvstate.errors import (
    BatchMismatchError,
    DeviceMismatchError,
    DtypeMismatchError,
    EmptyStateError,
    FingerprintMismatchError,
    InputError,
    KVStateError,
    MaskError,
    PositionError,
    RollbackError,
    UnsupportedModelError,
)
from tiny import WINDOW, prompt, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture
def session(model):
    s = Session(model)
    s.extend(prompt(10))
    return s


def check_message(err: KVStateError) -> None:
    text = str(err)
    assert "expected:" in text and "found:" in text and "fix:" in text, text


def test_mask_length_must_be_processed_plus_new(session):
    with pytest.raises(MaskError) as info:
        session.extend(prompt(3, seed=2), attention_mask=torch.ones(1, 3))  # only the new part
    check_message(info.value)
    assert "(1, 13)" in str(info.value)


def test_mask_must_agree_with_state_padding(session):
    mask = torch.ones(1, 13)
    mask[0, 0] = 0
    with pytest.raises(MaskError, match="disagrees"):
        session.extend(prompt(3, seed=2), attention_mask=mask)


def test_positions_must_continue_the_state(session):
    with pytest.raises(PositionError) as info:
        session.extend(prompt(2, seed=2), position_ids=torch.tensor([[9, 10]]))  # re-uses 9
    check_message(info.value)
    logits = session.extend(prompt(2, seed=2), position_ids=torch.tensor([[10, 11]]))
    assert logits.shape == (1, 128)


def test_continuation_into_empty_state(model):
    s = Session(model)
    with pytest.raises(EmptyStateError) as info:
        s.extend(prompt(1), position_ids=torch.tensor([[5]]))  # seed 002: pos > 0, nothing cached
    check_message(info.value)
    assert isinstance(info.value, PositionError)


def test_state_from_another_model_is_refused(session):
    other = tiny_model("llama", seed=1)  # same config, different weights
    with pytest.raises(FingerprintMismatchError) as info:
        Session(other, state=session.state)
    check_message(info.value)
    assert "weights_digest" in str(info.value)
    with pytest.raises(FingerprintMismatchError, match="config_hash"):
        Session(tiny_model("qwen3"), state=replace(session.state, layers=session.state.layers))


def test_same_weights_fresh_instance_is_accepted(session):
    fresh = Session(tiny_model("llama"), state=session.state)
    assert fresh.state.tokens_seen == 10


def test_batch_mismatch(session):
    with pytest.raises(BatchMismatchError) as info:
        session.extend(prompt(3, batch=2))
    check_message(info.value)


def test_dtype_mismatch(session):
    wide = tiny_model("llama").to(torch.float64)
    with pytest.raises(DtypeMismatchError) as info:
        Session(wide, state=session.state)
    check_message(info.value)


def test_device_mismatch(session):
    with pytest.raises(DeviceMismatchError) as info:
        Session(session.model, state=session.state.to("meta"))
    check_message(info.value)


def test_rollback_past_retention():
    s = Session(tiny_model("gemma3_text"), sliding_reserve=0, canonical_chunk=0)
    s.extend(prompt(2 * WINDOW))
    s.extend(prompt(1, seed=3))  # the state can return to before this append, not further
    with pytest.raises(RollbackError) as info:
        s.truncate(2 * WINDOW - 1)
    check_message(info.value)
    assert "layer 0" in str(info.value)
    with pytest.raises(RollbackError, match="out of range"):
        s.truncate(100)


def test_unsupported_model_names_its_type():
    from transformers import BertConfig, BertLMHeadModel

    bidirectional = BertLMHeadModel(BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=16,
                                               intermediate_size=32, vocab_size=64)).eval()
    with pytest.raises(UnsupportedModelError, match="bert failed kvstate's self-check") as info:
        Session(bidirectional)
    assert "attention is not causal" in str(info.value)
    check_message(info.value)


def test_a_model_with_active_dropout_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64))  # training mode
    with pytest.raises(InputError, match="dropout") as info:
        Session(model)
    check_message(info.value)
    Session(model.eval())


def test_bad_input_ids(session):
    with pytest.raises(InputError, match="token ids"):
        session.extend(torch.rand(1, 3))
    with pytest.raises(InputError, match="at least one"):
        session.extend(torch.zeros(1, 0, dtype=torch.long))


def test_beam_search_is_refused_clearly(session):
    with pytest.raises(kvstate.UnsupportedError, match="beam"):
        session.generate(prompt(12), num_beams=2, max_new_tokens=2)


def test_errors_share_one_hierarchy():
    for cls in (MaskError, PositionError, EmptyStateError, BatchMismatchError, DtypeMismatchError,
                DeviceMismatchError, FingerprintMismatchError, RollbackError, UnsupportedModelError):
        assert issubclass(cls, KVStateError)


@pytest.mark.parametrize("call", ["generate", "extend"])
def test_a_batch_of_no_rows_is_refused(call):
    session = Session(tiny_model("llama"))
    ids = torch.zeros(0, 5, dtype=torch.long)
    with pytest.raises(InputError, match="no row"):
        session.generate(ids, max_new_tokens=2) if call == "generate" else session.extend(ids)
    assert session.state.is_empty


@pytest.mark.parametrize("setting, least", [("canonical_chunk", "canonical_chunk=0 (off) or more"),
                                            ("max_checkpoints", "max_checkpoints=0 (off) or more"),
                                            ("chunk_size", "chunk_size=1 or more")])
def test_a_setting_below_its_least_value_names_that_value_in_the_fix(setting, least):
    """0 is a valid canonical chunk (the schedule off): the fix must not ask for 1 or more."""
    with pytest.raises(InputError) as info:
        Session(tiny_model("llama"), **{setting: -1})
    assert info.value.fix == f"pass {least}", info.value.fix
