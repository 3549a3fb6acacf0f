"""Families that require their own cache: MiniMax, xLSTM and RWKV.

Their forward refuses a ``DynamicCache`` (MiniMax), reads fields only its class has
(xLSTM's ``rnn_state``) or takes no transformers cache at all (RWKV's ``state`` list),
so the structural adapter cannot hold them; these adapters move the same per-layer
states through the model's own form (``_compat``). No such state can be cropped, so
rollback goes through checkpoints, as for every recurrent layer.
"""

from __future__ import annotations

from typing import Any

import torch

from .._compat import own_cache
from ..layers import LayerState
from .base import Capabilities
from .recurrent import RecurrentAdapter


class MiniMaxAdapter(RecurrentAdapter):
    """MiniMax: softmax attention layers plus lightning (linear) attention layers, whose
    ``[B, H, D, D]`` states are ``RecurrentLayerState.recurrent[0]``."""

    def __init__(self) -> None:
        super().__init__(name="minimax")

    def build_cache(self, model: torch.nn.Module, layers: tuple[LayerState, ...], batch_size: int) -> Any:
        return own_cache.minimax_cache(layers, self.text_config(model))

    def read_cache(self, model: torch.nn.Module, cache: Any, layers: tuple[LayerState, ...],
                   positions: torch.Tensor, tokens_seen: int) -> tuple[LayerState, ...]:
        return own_cache.read_minimax(cache, layers, positions, tokens_seen)

    def empty_cache(self, model: torch.nn.Module, batch_size: int) -> Any:
        return self.build_cache(model, self.empty_layers(model, 0), batch_size)


class _RecurrentOnly(RecurrentAdapter):
    """Every block holds recurrent state only; the config's own cache layers (attention, for
    xLSTM) are never used. Such forwards take no positions and ignore the mask (no padding)."""

    def __init__(self, caps: Capabilities) -> None:
        super().__init__(caps=caps)

    def layer_specs(self, model: torch.nn.Module) -> list[tuple[str, int | None]]:
        return [("recurrent", None)] * int(self.text_config(model).num_hidden_layers)

    def kv_shapes(self, model: torch.nn.Module) -> list[tuple[int, int, int] | None]:
        return [None] * int(self.text_config(model).num_hidden_layers)


class XLSTMAdapter(_RecurrentOnly):
    """xLSTM: one mLSTM state per block, ``recurrent`` = ``{0: C, 1: N, 2: M}``; its forward
    returns every position's logits."""

    def __init__(self) -> None:
        super().__init__(Capabilities(name="xlstm", position_ids=False, padding=False, logits_to_keep=False))

    def build_cache(self, model: torch.nn.Module, layers: tuple[LayerState, ...], batch_size: int) -> Any:
        return own_cache.xlstm_cache(layers, self.text_config(model), batch_size, next(model.parameters()))

    def read_cache(self, model: torch.nn.Module, cache: Any, layers: tuple[LayerState, ...],
                   positions: torch.Tensor, tokens_seen: int) -> tuple[LayerState, ...]:
        return own_cache.read_xlstm(cache, tokens_seen)

    def empty_cache(self, model: torch.nn.Module, batch_size: int) -> Any:
        return None  # as plain generate starts: its compile check reads attributes xLSTMCache lacks


class RWKVAdapter(_RecurrentOnly):
    """RWKV (v4): per block two token-shift vectors and the WKV numerator, denominator and
    running max, all ``[B, hidden]``, passed as ``state=`` and updated in place."""

    def __init__(self) -> None:
        super().__init__(Capabilities(name="rwkv", position_ids=False, padding=False, cache_kwarg="state"))

    def build_cache(self, model: torch.nn.Module, layers: tuple[LayerState, ...], batch_size: int) -> Any:
        hidden = int(self.text_config(model).hidden_size)
        return own_cache.rwkv_state(layers, batch_size, hidden, model.get_input_embeddings().weight)  # type: ignore[operator]

    def read_cache(self, model: torch.nn.Module, cache: Any, layers: tuple[LayerState, ...],
                   positions: torch.Tensor, tokens_seen: int) -> tuple[LayerState, ...]:
        return own_cache.read_rwkv(cache, tokens_seen)

    def empty_cache(self, model: torch.nn.Module, batch_size: int) -> Any:
        return None  # as plain generate starts; the replaced prefill hands it the real state

    def lm_output(self, model: torch.nn.Module, logits: torch.Tensor, cache: Any) -> Any:
        return own_cache.rwkv_output(logits, cache)

    def prepare(self, model: torch.nn.Module) -> None:
        own_cache.rwkv_rescale(model)
