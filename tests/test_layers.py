"""Bookkeeping without a model: tokens seen vs slots stored, rollback rules, immutability."""

from __future__ import annotations

import pytest
import torch

from kvstate import State
from kvstate.errors import RollbackError
from kvstate.layers import AttentionLayerState


def kv(B=1, H=2, S=5, D=4):
    return torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.arange(S).expand(B, S)


def test_sliding_layer_keeps_window_minus_one_plus_reserve():
    layer = AttentionLayerState.empty(window=4, reserve=2)
    k, v, p = kv(S=10)
    layer = layer.appended(k, v, p, tokens_seen=10)
    assert layer.tokens_seen == 10 and layer.slots == 4 - 1 + 2
    assert layer.positions[0].tolist() == [5, 6, 7, 8, 9]
    assert torch.equal(layer.keys, k[:, :, -5:])


def test_full_layer_truncates_anywhere_and_tracks_both_counts():
    k, v, p = kv(S=6)
    layer = AttentionLayerState.empty().appended(k, v, p, 6)
    cut = layer.truncated(2)
    assert (cut.tokens_seen, cut.slots) == (2, 2)
    assert layer.slots == 6  # the original is untouched
    assert layer.truncated(0).slots == 0


def test_sliding_rollback_limit():
    k, v, p = kv(S=20)
    layer = AttentionLayerState.empty(window=4, reserve=2).appended(k, v, p, 20)
    assert layer.rollback_limit(18) is None  # drops 2 of the 5 retained, 3 remain = window - 1
    assert "needs 3" in layer.rollback_limit(17)
    with pytest.raises(RollbackError):
        layer.truncated(17)


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
    layer = AttentionLayerState.empty(window=4).appended(big_k, big_v, p, 100)
    assert layer.nbytes == 2 * (1 * 2 * 3 * 4) * 4 + 3 * 8


def test_declared_layer_layout_follows_config_edits():
    """``layer_specs`` is remembered per config object (issue 11's load budget), never past an edit."""
    from transformers import Gemma3TextConfig

    from kvstate import _compat

    config = Gemma3TextConfig(num_hidden_layers=4, sliding_window=8, vocab_size=64, hidden_size=32,
                              intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    first = _compat.layer_specs(config)
    assert ("sliding_attention", 8) in first and _compat.layer_specs(config) == first
    config.sliding_window = 16
    assert ("sliding_attention", 16) in _compat.layer_specs(config)
    config.layer_types = ["full_attention"] * 4
    assert _compat.layer_specs(config) == [("full_attention", None)] * 4
    other = Gemma3TextConfig(num_hidden_layers=2, sliding_window=8, vocab_size=64, hidden_size=32,
                             intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    assert len(_compat.layer_specs(other)) == 2
