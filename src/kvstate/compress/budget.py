"""Which slots survive, from scores and a budget: pure code on tensors, testable without a model.

Every function takes, per attention layer, ``scores`` ``[B, H, S]`` (float; ``+inf``: must stay,
``-inf``: must go) and ``valid`` ``[B, H, S]`` (False on padding, which is never a candidate and never
kept), and returns ``[B, H, S]`` bool keep masks. Ties go to the earlier slot, so a choice is a
function of the scores alone.

* ``layer_keep``: each head keeps its ``k`` best slots (kvpress's per-head selection).
* ``global_keep``: one ranking across every layer and head (KVzip's): of the ``N`` candidate entries a
  row holds, ``N - int(ratio * N)`` may be held, padding included, so "50%" means half the K/V bytes:
  ``count="filled"`` (the default) cuts the ranking short until the layers, each padded to its fullest
  head, fit, then every head keeps as many as its layer's fullest (``fill_heads``: its next-best slots,
  in bytes held anyway); ``"padded"`` is the cut alone; ``"entries"`` counts the kept entries alone (their
  padding holds more); ``"bytes"`` gives every head of a layer the same number (``even_heads``).
  Each head first keeps ``int(floor * (1 - ratio) * n)`` of its ``n`` candidates (Ada-KV's safeguard). With
  ``sliding="whole"`` one kind of layer stays whole and the other gives the ratio (ranked among its own):
  the kind that, giving it alone, keeps the larger share of its own entries (the sliding layers on Gemma 3
  below about 2.5k tokens, where they hold most entries; the full layers beyond, as the reference keeps
  sliding layers whole), so no budget just big enough for one kind leaves the other almost nothing; only
  when neither kind can give it is every layer ranked together, as ``sliding="ranked"`` always does.
  ``sliding="recent"`` gives the full layers the budget first at every ratio: the sliding layers give
  first, each keeping its newest slots (the ones the next queries' windows still reach), down to their
  floors, then the full layers give the rest in one ranking (without a floor, refused). Gemma 3 retrieves
  through its few full layers: emptying them first loses every answer, and on RULER ranking them with the
  sliding layers loses more than keeping them whole (a single pass key favours the one ranking:
  docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import UnsupportedError

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
                ratio: float, floor: float = 0.0, mode: str = "whole", count: str = "filled") -> list[torch.Tensor]:
    """Keep masks of every layer under one ranking (see the module docstring); ``sliding[i]``: layer ``i``
    has a sliding window. ``count="entries"``: the ranking alone; ``"bytes"``: the ranking sets each layer's
    share, then every head of the layer keeps that share's mean count, its own best slots (``even_heads``);
    ``"padded"``: the ranking alone, cut short so that each layer padded to its fullest head fits the
    budget (``_padded_row``)."""
    ranked = [_with_floor(s.float().masked_fill(~v, -INF), v, ratio, floor) for s, v in zip(scores, valid,
                                                                                             strict=True)]
    if mode == "recent":  # a sliding layer's slots by age: the newest of every layer alike, kept slots first
        ranked = [_newest(r) if s else r for r, s in zip(ranked, sliding, strict=True)]
    B = ranked[0].shape[0] if ranked else 0
    keeps = [torch.zeros_like(v) for v in valid]
    for b in range(B):
        candidates = sum(int(v[b].sum()) for v in valid)
        rows, flags, budget = [r[b].flatten() for r in ranked], [bool(s) for s in sliding], \
            candidates - int(candidates * ratio)
        if mode == "recent" and floor <= 0:
            held = sum(int((row > -INF).sum()) for row, s in zip(rows, flags, strict=True) if not s)
            if budget < held and any(flags):
                raise UnsupportedError("sliding='recent' keeps the full-attention layers whole, and this budget "
                                       "cannot hold them", expected=f"at least {held} entries kept",
                                       found=f"{budget} (ratio {ratio})", fix="a smaller ratio, a floor above 0 "
                                       "(the sliding layers keep their floors, the full layers give the rest), "
                                       "or sliding='whole'")
        chosen = _padded_row(rows, flags, budget, mode, [r.shape[1] for r in ranked]) if count in ("padded", "filled") \
            else _row(rows, flags, budget, mode)
        for i, kept in enumerate(chosen):
            keeps[i][b] = kept.view(ranked[i].shape[1:])
    if count == "bytes":
        keeps = even_heads([k & v for k, v in zip(keeps, valid, strict=True)], ranked, valid)
    elif count == "filled":
        keeps = fill_heads([k & v for k, v in zip(keeps, valid, strict=True)], ranked, valid)
    return [k & v for k, v in zip(keeps, valid, strict=True)]


def _padded_row(rows: list[torch.Tensor], sliding: list[bool], budget: int, mode: str,
                heads: list[int]) -> list[torch.Tensor]:
    """``_row`` with the most entries whose padded size (each layer's heads times its fullest head's count)
    is within ``budget`` entries (a binary search over the ranking's length)."""
    def padded(chosen: list[torch.Tensor]) -> int:
        return sum(h * int(c.view(h, -1).sum(-1).max()) for c, h in zip(chosen, heads, strict=True) if c.numel())

    low, high = 0, budget  # padded(_row(.., low)) <= budget holds for 0 (only forced +inf slots aside)
    while low < high:
        mid = (low + high + 1) // 2
        if padded(_row(rows, sliding, mid, mode)) <= budget:
            low = mid
        else:
            high = mid - 1
    return _row(rows, sliding, low, mode)


def even_heads(keeps: Sequence[torch.Tensor], scores: Sequence[torch.Tensor],
               valid: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every head of a layer keeps the same number of slots, its own best: the layer's share of ``keeps``
    divided by its ``H`` heads, rounded down, then one more slot per head in the layers with the largest
    remainders while the total stays within ``keeps``'s (so within ``H - 1`` entries of it).

    A layer stores its heads as one ``[B, H, S', D]`` tensor, ``S'`` its fullest head's count: heads that keep
    unequal counts pad the others, so the bytes held exceed the entries kept (by 38% on SmolLM2 at 50%).
    Equal counts hold exactly the entries kept."""
    out = [torch.zeros_like(k) for k in keeps]
    for b in range(keeps[0].shape[0] if keeps else 0):
        totals = [int(k[b].sum()) for k in keeps]
        heads = [k.shape[1] for k in keeps]
        each = [t // h for t, h in zip(totals, heads, strict=True)]
        left = sum(totals) - sum(e * h for e, h in zip(each, heads, strict=True))
        for i in sorted(range(len(keeps)), key=lambda i: (-(totals[i] - each[i] * heads[i]), i)):
            if totals[i] - each[i] * heads[i] > 0 and heads[i] <= left:
                each[i], left = each[i] + 1, left - heads[i]
        for i, k in enumerate(each):
            out[i][b] = layer_keep(scores[i][b:b + 1], valid[i][b:b + 1], k)[0]
    return out


def fill_heads(keeps: Sequence[torch.Tensor], scores: Sequence[torch.Tensor],
               valid: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Every head of a layer keeps as many slots as the layer's fullest head in ``keeps``, its own best: the
    padded ``[B, H, S', D]`` tensor holds those bytes anyway. Each head's kept slots are its best-scored, so
    its keep set only grows."""
    out = []
    for k, s, v in zip(keeps, scores, valid, strict=True):
        rows = [layer_keep(s[b:b + 1], v[b:b + 1], int(k[b].sum(-1).max()))[0] if k[b].numel() else k[b]
                for b in range(k.shape[0])]
        out.append(torch.stack(rows) if rows else k)
    return out


def _newest(scores: torch.Tensor) -> torch.Tensor:
    """``[..., S]``: minus each slot's distance from the layer's newest (slots are in time order), ``+inf``
    and ``-inf`` kept: a score that ranks every sliding layer's newest slots first, alike."""
    age = torch.arange(scores.shape[-1], device=scores.device, dtype=scores.dtype) - scores.shape[-1]
    return torch.where(scores.isinf(), scores, age.expand_as(scores))


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
    held = sum(int((rows[i] > -INF).sum()) for i in full)
    forced = sum(int((rows[i] == INF).sum()) for i in full)
    out: list[torch.Tensor] = [rows[i] > -INF for i in range(len(rows))]
    # the kind that, giving the ratio alone, keeps the larger share of its own entries gives and the other stays
    # whole: (B - W) / F >= (B - F) / W (equal shares where both kinds hold as many: no jump as a context grows)
    if budget >= window + forced and mode != "recent" and (budget - window) * window >= (budget - held) * held:
        give, rest = full, budget - window
    else:  # the full layers stay whole and the sliding ones give, else one ranking decides
        floors = sum(int((rows[i] == INF).sum()) for i in slide)
        if budget >= held + floors:
            give, rest = slide, budget - held
        elif mode == "recent":  # the sliding layers keep their floors alone, the full layers give the rest
            for i in slide:
                out[i] = rows[i] == INF
            give, rest = full, max(budget - floors, 0)
        else:
            return _top(rows, budget)
    for i, kept in zip(give, _top([rows[i] for i in give], rest), strict=True):
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
