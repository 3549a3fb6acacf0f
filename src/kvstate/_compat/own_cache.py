"""Models with a cache class of their own (MiniMax, xLSTM) or none (RWKV's ``state`` list).

Their transformers internals, read and written here only; see ``core`` for the shared cache.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layers import LayerState, RecurrentLayerState, StatelessLayerState
from .core import build_cache, read_cache


def minimax_cache(layers: tuple[LayerState, ...], config: object) -> Any:
    """MiniMax's own ``MiniMaxCache``: softmax layers in ``layers``, lightning-attention states
    ``[B, H, D, D]`` in ``linear_cache`` (None: start from zeros). Empty ``LinearAttentionLayer``
    placeholders stand where the linear layers are, so the cache's length comes from a softmax
    layer; MiniMax's lazily made ``DynamicLayer`` there would report 0 past tokens and size the
    mask of a multi-token continuation wrongly."""
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    cache = MiniMaxCache()
    cache.layers = build_cache(tuple(RecurrentLayerState({}, {}, 0) if isinstance(layer, RecurrentLayerState)
                                     else layer for layer in layers), config).layers
    # the model replaces these tensors after each forward, never writes into them
    cache.linear_cache = [layer.recurrent.get(0) if isinstance(layer, RecurrentLayerState) else []
                          for layer in layers]
    return cache


def read_minimax(cache: Any, layers: tuple[LayerState, ...], new_positions: torch.Tensor,
                 tokens_seen: int) -> tuple[LayerState, ...]:
    """The state after a forward on a ``minimax_cache``."""
    linear = [isinstance(layer, RecurrentLayerState) for layer in layers]
    attention = read_cache(cache, tuple(StatelessLayerState(layer.tokens_seen) if is_linear else layer
                                        for layer, is_linear in zip(layers, linear, strict=True)),
                           new_positions, tokens_seen)
    return tuple(RecurrentLayerState({}, {0: cache.linear_cache[i]}, tokens_seen) if is_linear else new
                 for i, (new, is_linear) in enumerate(zip(attention, linear, strict=True)))


def xlstm_cache(layers: tuple[LayerState, ...], config: Any, batch_size: int, like: torch.Tensor) -> Any:
    """xLSTM's own ``xLSTMCache``: per block the mLSTM ``(C [B, H, Dqk, Dv], N [B, H, Dqk], M [B, H, 1])``,
    cloned because the model copies into them. Its dtype is the model's (the class defaults to bf16)."""
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    cache = xLSTMCache(config, batch_size, dtype=like.dtype, device=like.device)
    for i, layer in enumerate(layers):
        if isinstance(layer, RecurrentLayerState) and layer.recurrent:
            cache.rnn_state[i] = tuple(layer.recurrent[j].clone() for j in range(len(layer.recurrent)))
    cache.seqlen_offset = torch.tensor([layers[0].tokens_seen], device=like.device)
    return cache


def read_xlstm(cache: Any, tokens_seen: int) -> tuple[LayerState, ...]:
    """The state after a forward on an ``xlstm_cache``."""
    return tuple(RecurrentLayerState({}, dict(enumerate(cache.rnn_state[i])), tokens_seen)
                 for i in range(len(cache.rnn_state)))


def rwkv_state(layers: tuple[LayerState, ...], batch_size: int, hidden: int, like: torch.Tensor) -> list[torch.Tensor]:
    """RWKV's ``state``: five ``[B, hidden, L]`` tensors (feed-forward shift, attention shift in the
    model dtype; numerator, denominator, running max in fp32), filled in place by its forward.
    Empty layers start as RWKV's own forward starts them (zeros, max -1e30)."""
    shape = (batch_size, hidden, len(layers))
    state = [torch.zeros(shape, dtype=like.dtype if i <= 1 else torch.float32, device=like.device) for i in range(5)]
    state[4] -= 1e30
    for i, layer in enumerate(layers):
        if isinstance(layer, RecurrentLayerState) and layer.recurrent:
            for j, part in enumerate((layer.conv[0], layer.conv[1], *(layer.recurrent[k] for k in range(3)))):
                state[j][:, :, i] = part
    return state


def read_rwkv(state: list[torch.Tensor], tokens_seen: int) -> tuple[LayerState, ...]:
    """Per layer ``conv = {0: ffn shift, 1: attention shift}``, ``recurrent = {0: num, 1: den, 2: max}``,
    each ``[B, hidden]``, after a forward on ``rwkv_state``."""
    return tuple(RecurrentLayerState({j: state[j][:, :, i].clone() for j in range(2)},
                                     {k: state[2 + k][:, :, i].clone() for k in range(3)}, tokens_seen)
                 for i in range(state[0].shape[2]))


def rwkv_output(logits: torch.Tensor, state: list[torch.Tensor]) -> Any:
    """RWKV's output class: its generate carries ``state`` from one step to the next."""
    from transformers.models.rwkv.modeling_rwkv import RwkvCausalLMOutput

    return RwkvCausalLMOutput(logits=logits, state=state)


def rwkv_rescale(model: Any) -> None:
    """RWKV divides some weights by powers of two on its first inference forward
    (``config.rescale_every``); doing it now keeps the weights' fingerprint stable."""
    inner = getattr(model, "rwkv", model)
    if not inner.training:
        inner._rescale_layers()
