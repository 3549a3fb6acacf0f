"""Bookkeeping without a model: tokens seen vs slots stored, rollback rules, immutability."""

from __future__ import annotations

import pytest
import torch

from kvstate import State
from kvstate.errors import RollbackError
from kvstate.layers import AttentionLayerState


def kv(B=1, H=2, S=5, D=4):
    return torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.arange(S).expand(B, S)


def test_sliding_layer_keeps_window_minus_one_plus_reserve_past_its_last_append():
    layer = AttentionLayerState.empty(window=4, reserve=2)
    k, v, p = kv(S=12)
    first = layer.appended(k[:, :, :8], v[:, :, :8], p[:, :8], tokens_seen=8)
    assert first.slots == 8  # one append of 8 is kept whole: the state can return to where it started
    second = first.appended(k[:, :, :10], v[:, :, :10], p[:, :10], tokens_seen=10)  # + 2 slots
    assert second.tokens_seen == 10 and second.slots == 4 - 1 + 2 + 2
    assert second.positions[0].tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert torch.equal(second.keys, k[:, :, 3:10])
    assert second.rollback_limit(8 - 2) is None and second.rollback_limit(8 - 3) is not None  # reserve past 8
    third = second.appended(torch.cat([second.keys, k[:, :, 10:]], 2), torch.cat([second.values, v[:, :, 10:]], 2),
                            torch.cat([second.positions, p[:, 10:]], 1), tokens_seen=12)
    assert third.slots == 4 - 1 + 2 + 2 and third.positions[0].tolist() == [5, 6, 7, 8, 9, 10, 11]


def test_full_layer_truncates_anywhere_and_tracks_both_counts():
    k, v, p = kv(S=6)
    layer = AttentionLayerState.empty().appended(k, v, p, 6)
    cut = layer.truncated(2)
    assert (cut.tokens_seen, cut.slots) == (2, 2)
    assert layer.slots == 6  # the original is untouched
    assert layer.truncated(0).slots == 0


def test_sliding_rollback_limit():
    k, v, p = kv(S=20)
    layer = AttentionLayerState.empty(window=4, reserve=2).appended(k[:, :, :19], v[:, :, :19], p[:, :19], 19)
    layer = layer.appended(k, v, p, 20)  # keeps window - 1 + reserve + the 1 appended = 6
    assert layer.rollback_limit(17) is None  # drops 3 of the 6 retained, 3 remain = window - 1
    assert "needs 3" in layer.rollback_limit(16)
    with pytest.raises(RollbackError):
        layer.truncated(16)


def test_state_truncation_moves_positions_back_and_drops_logits():
    k, v, p = kv(S=6)
    layer = AttentionLayerState.empty().appended(k, v, p, 6)
    mask = torch.tensor([[False, True, True, True, True, True]])
    positions = torch.tensor([[0, 0, 1, 2, 3, 4]])
    state = State(tokens=torch.arange(6)[None], mask=mask, positions=positions, layers=(layer,),
                  next_position=torch.tensor([5]), last_logits=torch.zeros(1, 3))
    cut = state.truncated(3)
    assert cut.next_position.tolist() == [2] and cut.last_logits is None
    assert state.tokens_seen == 6 and cut.tokens_seen == 3
    assert cut.summary()["layers"][0] == {"kind": "full_attention", "tokens_seen": 3, "slots": 3,
                                          "window": None, "reserve": 0, "compressed_at": None}


def test_nbytes_counts_only_retained_slots():
    big_k, big_v, p = kv(S=100)
    layer = AttentionLayerState.empty(window=4).appended(big_k[:, :, :99], big_v[:, :, :99], p[:, :99], 99)
    layer = layer.appended(big_k, big_v, p, 100)  # keeps 3 + the 1 appended, views of 100
    assert layer.nbytes == 2 * (1 * 2 * 4 * 4) * 4 + 4 * 8


def test_declared_layer_layout_follows_config_edits():
    """``layer_specs`` is remembered per config object (a state load asks for it many times), never past an edit."""
    from transformers import Gemma3TextConfig

    from kvstate._compat import core as _compat_core

    config = Gemma3TextConfig(num_hidden_layers=4, sliding_window=8, vocab_size=64, hidden_size=32,
                              intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    first = _compat_core.layer_specs(config)
    assert ("sliding_attention", 8) in first and _compat_core.layer_specs(config) == first
    config.sliding_window = 16
    assert ("sliding_attention", 16) in _compat_core.layer_specs(config)
    config.layer_types = ["full_attention"] * 4
    assert _compat_core.layer_specs(config) == [("full_attention", None)] * 4
    other = Gemma3TextConfig(num_hidden_layers=2, sliding_window=8, vocab_size=64, hidden_size=32,
                             intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    assert len(_compat_core.layer_specs(other)) == 2
