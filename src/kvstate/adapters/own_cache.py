"""Families that require their own transformers cache class: MiniMax and xLSTM.

Their forward refuses a ``DynamicCache`` (MiniMax) or reads fields only its class has
(xLSTM's ``rnn_state``), so the structural adapter cannot hold them; these adapters
move the same per-layer states through the model's own class (``_compat``). Neither
state can be cropped, so rollback goes through checkpoints, as for every recurrent layer.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _compat
from ..layers import LayerState
from .base import Capabilities
from .recurrent import RecurrentAdapter


class MiniMaxAdapter(RecurrentAdapter):
    """MiniMax: softmax attention layers plus lightning (linear) attention layers, whose
    ``[B, H, D, D]`` states are ``RecurrentLayerState.recurrent[0]``."""

    def __init__(self) -> None:
        super().__init__(name="minimax")

    def build_cache(self, model: torch.nn.Module, layers: tuple[LayerState, ...], batch_size: int) -> Any:
        return _compat.minimax_cache(layers, self.text_config(model))

    def read_cache(self, model: torch.nn.Module, cache: Any, layers: tuple[LayerState, ...],
                   positions: torch.Tensor, tokens_seen: int) -> tuple[LayerState, ...]:
        return _compat.read_minimax(cache, layers, positions, tokens_seen)

    def empty_cache(self, model: torch.nn.Module, batch_size: int) -> Any:
        return self.build_cache(model, self.empty_layers(model, 0), batch_size)


class XLSTMAdapter(RecurrentAdapter):
    """xLSTM: one mLSTM state per block, ``recurrent`` = ``{0: C, 1: N, 2: M}``. Its forward takes
    no positions, ignores the attention mask (no padding) and returns every position's logits."""

    def __init__(self) -> None:
        super().__init__(position_ids=False, name="xlstm")
        self.caps = Capabilities(name="xlstm", position_ids=False, padding=False, logits_to_keep=False)

    def layer_specs(self, model: torch.nn.Module) -> list[tuple[str, int | None]]:
        # the config builds a DynamicCache of attention layers, which xLSTM never uses
        return [("recurrent", None)] * int(self.text_config(model).num_hidden_layers)

    def kv_shapes(self, model: torch.nn.Module) -> list[tuple[int, int, int] | None]:
        return [None] * int(self.text_config(model).num_hidden_layers)

    def build_cache(self, model: torch.nn.Module, layers: tuple[LayerState, ...], batch_size: int) -> Any:
        return _compat.xlstm_cache(layers, self.text_config(model), batch_size, next(model.parameters()))

    def read_cache(self, model: torch.nn.Module, cache: Any, layers: tuple[LayerState, ...],
                   positions: torch.Tensor, tokens_seen: int) -> tuple[LayerState, ...]:
        return _compat.read_xlstm(cache, tokens_seen)

    def empty_cache(self, model: torch.nn.Module, batch_size: int) -> Any:
        return None  # as plain generate starts: its compile check reads attributes xLSTMCache lacks
