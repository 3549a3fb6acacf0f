"""Which slots survive, from scores and a budget: pure code on tensors, testable without a model.

Every function takes, per attention layer, ``scores`` ``[B, H, S]`` (float; ``+inf``: must stay,
``-inf``: must go) and ``valid`` ``[B, H, S]`` (False on padding, which is never a candidate and never
kept), and returns ``[B, H, S]`` bool keep masks. Ties go to the earlier slot, so a choice is a
function of the scores alone.

* ``layer_keep``: each head keeps its ``k`` best slots (kvpress's per-head selection).
* ``global_keep``: one ranking across every layer and head (KVzip's): of the ``N`` candidate entries a
  row holds, ``N - int(ratio * N)`` stay, so "50%" means half the K/V entries. Each head first keeps
  ``int(floor * (1 - ratio) * n)`` of its ``n`` candidates (Ada-KV's safeguard). With ``sliding="whole"``
  the sliding-window layers stay whole while the full-attention layers can give the whole ratio above
  their floors; otherwise the full layers keep only their floors and the sliding layers give the rest,
  ranked among themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

INF = float("inf")


def order(scores: torch.Tensor) -> torch.Tensor:
    """Indices sorting the last dim by descending score, ties to the earlier index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def layer_keep(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, H, S]``: each head's ``k`` best valid slots (all of them when it holds fewer; ``+inf`` first)."""
    ranked = scores.float().masked_fill(~valid, -INF)
    keep = torch.zeros_like(valid)
    if k > 0:
        keep.scatter_(-1, order(ranked)[..., :k], True)
    return keep & valid & (ranked > -INF)


def global_keep(scores: Sequence[torch.Tensor], valid: Sequence[torch.Tensor], sliding: Sequence[bool],
                ratio: float, floor: float = 0.0, mode: str = "whole") -> list[torch.Tensor]:
    """Keep masks of every layer under one ranking (see the module docstring); ``sliding[i]``: layer ``i``
    has a sliding window."""
    ranked = [_with_floor(s.float().masked_fill(~v, -INF), v, ratio, floor) for s, v in zip(scores, valid,
                                                                                             strict=True)]
    B = ranked[0].shape[0] if ranked else 0
    keeps = [torch.zeros_like(v) for v in valid]
    for b in range(B):
        candidates = sum(int(v[b].sum()) for v in valid)
        chosen = _row([r[b].flatten() for r in ranked], [bool(s) for s in sliding],
                      candidates - int(candidates * ratio), mode)
        for i, kept in enumerate(chosen):
            keeps[i][b] = kept.view(ranked[i].shape[1:])
    return [k & v for k, v in zip(keeps, valid, strict=True)]


def _with_floor(scores: torch.Tensor, valid: torch.Tensor, ratio: float, floor: float) -> torch.Tensor:
    """``scores`` with each head's ``int(floor * int((1 - ratio) * n))`` best candidates (at least one when the
    floor is above 0) made ``+inf``: Ada-KV's ``alpha_safeguard``, per head of ``n`` candidates."""
    if floor <= 0:
        return scores
    n = valid.sum(-1, keepdim=True)  # [B, H, 1]
    kept = ((1 - ratio) * n).long().clamp_min(1)
    safe = (floor * kept).long().clamp_min(1).clamp_max(n)
    rank = torch.empty_like(scores, dtype=torch.long)
    rank.scatter_(-1, order(scores), torch.arange(scores.shape[-1], device=scores.device).expand_as(scores))
    return scores.masked_fill((rank < safe) & (scores > -INF), INF)


def _row(rows: list[torch.Tensor], sliding: list[bool], budget: int, mode: str) -> list[torch.Tensor]:
    """One batch row: the flat keep mask of every layer, ``budget`` entries in all (padding is ``-inf``)."""
    if mode == "ranked" or not any(sliding) or all(sliding):
        return _top(rows, budget)
    full = [i for i, s in enumerate(sliding) if not s]
    slide = [i for i, s in enumerate(sliding) if s]
    window = sum(int((rows[i] > -INF).sum()) for i in slide)
    forced = sum(int((rows[i] == INF).sum()) for i in full)
    out: list[torch.Tensor] = [torch.zeros_like(r, dtype=torch.bool) for r in rows]
    if budget >= window + forced:  # the full layers can give the whole ratio: sliding layers stay whole
        picked = _top([rows[i] for i in full], budget - window)
        kept_slide = [rows[i] > -INF for i in slide]
    else:  # the full layers keep their floors; the sliding layers give the rest
        picked = [rows[i] == INF for i in full]
        kept_slide = _top([rows[i] for i in slide], budget - forced)
    for i, kept in zip(full, picked, strict=True):
        out[i] = kept
    for i, kept in zip(slide, kept_slide, strict=True):
        out[i] = kept
    return out


def _top(rows: list[torch.Tensor], budget: int) -> list[torch.Tensor]:
    """The ``budget`` best entries over ``rows`` (every ``+inf`` kept, no ``-inf``), as one mask per row."""
    if not rows:
        return []
    flat = torch.cat(rows)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    take = min(max(budget, int((flat == INF).sum())), int((flat > -INF).sum()))
    if take > 0:
        keep[order(flat)[:take]] = True
    return list(keep.split([r.numel() for r in rows]))
