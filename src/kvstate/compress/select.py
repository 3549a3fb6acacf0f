"""Building a compressed layer from keep masks: shared slots, or each KV head's own, right-aligned.

A layer whose heads all keep the same slots (and every row as many) stays in the shared
layout: ``[B, H, k, D]`` K/V and ``[B, k(, R)]`` positions, as before per-head compression.
Otherwise each head's kept slots are gathered in slot order and right-aligned in ``[B, H, K, D]``,
``K`` the most any head (or row) keeps; the slots in front are padding: zero K/V and position
``PAD`` (``kvstate.layers``). The tensors are new, so the evicted slots' memory goes with the old state.
"""

from __future__ import annotations

import torch

from ..layers import PAD, AttentionLayerState


def rebuild(layer: AttentionLayerState, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
            keep: torch.Tensor, tokens_seen: int, per_head: bool) -> AttentionLayerState:
    """``layer`` holding the slots ``keep`` ``[B, H, S]`` marks among ``keys``/``values`` ``[B, H, S, D]`` at
    ``positions`` (``[B, S(, R)]``, or ``[B, H, S(, R)]`` when ``per_head``), compressed at ``tokens_seen``."""
    if not per_head and shared(keep):
        index = keep[:, 0].nonzero()[:, 1].view(keep.shape[0], -1)  # [B, k], in slot order
        B, H, _, D = keys.shape
        k = index.shape[1]
        gather = index[:, None, :, None]
        kept = positions.gather(1, index if positions.dim() == 2 else index[..., None].expand(-1, -1,
                                                                                             positions.shape[2]))
        return layer.with_slots(keys.gather(2, gather.expand(B, H, k, D)),
                                values.gather(2, gather.expand(B, H, k, values.shape[-1])), kept,
                                compressed_at=tokens_seen, per_head=False)
    heads = positions if per_head else positions[:, None].expand(keys.shape[0], keys.shape[1], *positions.shape[1:])
    index, pad = right_aligned(keep)
    return layer.with_slots(_gather(keys, index, pad), _gather(values, index, pad), _gather(heads, index, pad, PAD),
                            compressed_at=tokens_seen, per_head=True)


def shared(keep: torch.Tensor) -> bool:
    """Every head of a row keeps the same slots, and every row as many."""
    counts = keep[:, 0].sum(-1)
    return bool((keep == keep[:, :1]).all()) and bool((counts == counts[0]).all())


def right_aligned(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [B, H, K], pad [B, H, K])``: per head, the kept slots in slot order at the end of ``K`` (the most
    kept by any head), padding (a dropped slot's index, flagged in ``pad``) in front."""
    S = keep.shape[2]
    width = int(keep.sum(-1).max()) if keep.numel() else 0
    rank = keep.long() * torch.arange(1, S + 1, device=keep.device)  # 0 for a dropped slot, else its order
    index = torch.sort(rank, dim=-1, stable=True).indices[..., S - width:]
    return index, ~keep.gather(-1, index)


def _gather(t: torch.Tensor, index: torch.Tensor, pad: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
    """``t`` ``[B, H, S, ...]`` gathered along the slots at ``index`` ``[B, H, K]``, ``fill`` where ``pad``."""
    extra = t.shape[3:]
    full = index.view(*index.shape, *([1] * len(extra))).expand(*index.shape, *extra)
    mask = pad.view(*pad.shape, *([1] * len(extra)))
    return t.gather(2, full).masked_fill(mask, fill)
