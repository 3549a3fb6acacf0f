"""Key re-rotation (``ReRotate``): retained keys moved to contiguous positions, RoPE applied by the delta."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .._compat.core import rope_inv_freq
from ..errors import UnsupportedError
from ..layers import AttentionLayerState
from ..state import State
from .observe import rotate_half


def rerotate(model: Any, state: State) -> State:
    """Move every layer's retained keys to positions ``0..S-1`` (RoPE by the position delta)."""
    layers = [layer for layer in state.layers if isinstance(layer, AttentionLayerState)]
    slots = {layer.slots for layer in layers}
    T = state.tokens_seen
    if any(layer.window is not None or layer.per_head for layer in layers) or len(slots) != 1 \
            or layers[0].positions is None or layers[0].positions.dim() != 2 or len(layers) != len(state.layers):
        raise UnsupportedError("ReRotate needs full-attention layers that all keep the same number of slots, "
                               "with 1-D positions", found=sorted(slots), fix="drop ReRotate or PerLayerBudget")
    if not torch.equal(state.positions, torch.arange(T, device=state.device).expand_as(state.positions)):
        raise UnsupportedError("ReRotate needs a history fed at positions 0..T-1", fix="drop ReRotate")
    inv_freq = rope_inv_freq(model)
    (S,) = slots
    target = torch.arange(S, device=state.device).expand(state.batch_size, S)
    new_layers = tuple(layer.with_slots(rotate(layer.keys, target - layer.positions, inv_freq),  # type: ignore[arg-type]
                                        layer.values, target) for layer in layers)
    track = torch.full_like(state.positions, -1)  # evicted tokens have no place in the new frame
    track.scatter_(1, layers[0].positions, target)  # type: ignore[arg-type]
    return replace(state, layers=new_layers, positions=track, next_position=torch.full_like(state.next_position, S))


def rotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys ``[B, H, S, D]`` rotated by ``delta`` ``[B, S]`` positions (RoPE composes additively)."""
    angles = delta[..., None].double() * inv_freq.double()  # [B, S, D/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None]
    k = keys.double()
    return (k * emb.cos() + rotate_half(k) * emb.sin()).to(keys.dtype)


