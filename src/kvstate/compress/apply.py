"""Applying a policy to a state: check, watch, score, choose, rebuild the layers, optionally re-rotate keys.

Selection keeps each retained slot's original logical position (per KV head when the
heads choose apart: ``kvstate.layers``) and marks the layer ``compressed_at``; the
state's ``next_position`` is untouched, so new tokens go in at their true position (the
mistake kvpress and an MLX port made was to infer it from the compressed length).
Recurrent and hybrid layers are never touched: they have no slots of their own.

A policy ranks each layer alone (its ``keep_count`` per head; sliding layers compress
within their window, or with ``sliding="context"`` only when their window exceeds the
budget) or, with a ``Ranking``, every slot of every attention layer and head together
(``kvstate.compress.budget``); under a ranking a sliding layer keeps at most its window.
A family whose attention cannot take per-head masks (``Capabilities.head_masks``) keeps
one slot set per layer (the most any head scores a slot), with a ``CompressionWarning``.
Every check runs before any forward: a policy that cannot run here refuses first.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._compat.core import has_decoder_layers
from .._compat.watch import out_projections
from ..errors import CompressionWarning, InputError, UnsupportedError
from ..layers import AttentionLayerState, attention_of, with_attention
from ..protocols import AttentionObserver
from ..state import MediaItem, State
from .budget import global_keep, layer_keep
from .observe import Seen, watch
from .policies import Facts, Policy, Ranking, ScoreInput
from .rotate import rerotate
from .wrappers import ReRotate

SLIDING = ("window", "context")


@dataclass
class _Layer:
    """One attention layer's candidates: its last ``len`` slots (a sliding layer's window), scored."""

    index: int
    layer: AttentionLayerState
    x: ScoreInput
    tokens: torch.Tensor | None  # [S] token index of each candidate slot (batch of 1, uncompressed), else None
    cut: bool  # slots in front of the candidates were left out (a sliding layer past its window)


def compress_state(observer: AttentionObserver, model: Any, state: State, policy: Policy, *,
                   query_ids: torch.Tensor | None = None, sliding: str = "window", budget: int | None = None,
                   tokenizer: Any = None) -> State:
    """``state`` with each attention layer reduced by ``policy``; a ratio of 0 returns it unchanged.

    ``query_ids`` ``[B, Q]``: score with the question's attention instead of the policy's own
    question-agnostic watch (the question is not fed; ``generate`` feeds it later).
    ``sliding`` (layer-ranked policies): what the ratio counts. ``"window"``: each layer evicts ``ratio``
    of the slots it holds, so a sliding layer compresses within its window. ``"context"`` (kvpress's
    meaning): every layer keeps at most ``(1 - ratio) * tokens_seen`` slots. ``budget``: keep at most this
    many slots per head in every attention layer instead (the ratio is not used; each layer is ranked
    alone); a state already within it is returned unchanged. ``tokenizer``: where KVzip finds its re-read.
    """
    _check(state, policy, query_ids, sliding, budget)
    n = len(state.layers)
    attention = [part for part in map(attention_of, state.layers) if part is not None]
    if budget is not None and all(part.slots <= budget for part in attention):
        return state
    if budget is None and not policy.evicts(n):
        return state  # ratio 0: the identity, bitwise, without re-running anything
    if not has_decoder_layers(model):
        raise UnsupportedError("compressed states need a mask per layer, which kvstate hands each decoder layer",
                               found=f"{observer.caps.name}: a decoder without a `layers` list",
                               fix="use the state uncompressed")
    policy.check(_facts(observer, model, state, policy.needs().normalize))
    ranking = None if budget is not None else policy.ranking()
    if ranking is not None and sliding != "window":
        raise InputError(f"{type(policy).__name__} ranks every layer together, so sliding='{sliding}' has no "
                         "meaning", expected="sliding='window' (the default)", found=sliding,
                         fix=f"pass scope='layer' to {type(policy).__name__} for the per-layer meanings")
    needs = policy.needs()
    seen, tail = watch(observer, model, state, needs, query_ids, tokenizer) if needs.watches else ({}, 0)
    layers = _candidates(state, policy, seen, tail, sliding, budget, trim=ranking is not None)
    keeps = _choose(policy, layers, ranking, observer.caps.head_masks, observer.caps.name)
    new = list(state.layers)
    kept_tokens: list[torch.Tensor | None] = []
    for c, keep in zip(layers, keeps, strict=True):
        if keep is None:
            continue
        if keep is not True:
            new[c.index] = with_attention(state.layers[c.index], _rebuilt(c, keep, state.tokens_seen))
        if c.layer.window is None:  # sliding layers forget anyway
            kept_tokens.append(None if c.tokens is None else _whole(c, keep))
    compressed = replace(state, layers=tuple(new), media=_surviving(state, kept_tokens))
    return rerotate(model, compressed) if isinstance(policy, ReRotate) else compressed


def _facts(observer: AttentionObserver, model: Any, state: State, projections: bool) -> Facts:
    """What the policy may check; the output projections are examined only when asked (KVzip+)."""
    caps = observer.caps
    attention = [i for i, layer in enumerate(state.layers) if attention_of(layer) is not None]
    dims = 1 if state.positions.dim() == 2 else int(state.positions.shape[-1])
    return Facts(caps.name, dims, bool(state.media), out_projections(model, attention) if projections else None)


def _check(state: State, policy: Policy, query_ids: torch.Tensor | None, sliding: str, budget: int | None) -> None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise InputError("invalid slot budget", expected="an int >= 1", found=repr(budget)[:40])
    if not isinstance(policy, Policy):
        raise InputError("compress takes a policy", expected="a kvstate.compress policy, e.g. KVzip(0.5)",
                         found=type(policy).__name__)
    if sliding not in SLIDING:
        raise InputError("unknown sliding-window meaning", expected=SLIDING, found=repr(sliding)[:40],
                         fix='"window" compresses within each window; "context" counts the budget as kvpress does')
    if state.is_empty:
        raise InputError("nothing to compress", expected="a state with processed tokens", found="an empty state")
    if not bool(state.mask.all()):
        raise UnsupportedError("compressing padded batches is not supported", found="padding in state.mask",
                               fix="compress one row per Session")
    if any(layer.kind == "indexed_attention" for layer in state.layers):
        raise UnsupportedError("compressing dynamic sparse attention (indexed) layers is not supported",
                               found="indexed_attention layers", fix="use the state uncompressed")
    if query_ids is not None and not policy.needs().watches:
        raise InputError(f"{type(policy).__name__} does not look at queries, so query_ids would be ignored",
                         expected="an attention-based policy (SnapKV, TOVA, KVzip, ExpectedAttention)",
                         found=type(policy).__name__, fix="drop query_ids, or pick an attention-based policy")


def _candidates(state: State, policy: Policy, seen: dict[int, Seen], tail: int, sliding: str, budget: int | None,
                trim: bool) -> list[_Layer]:
    """Every attention layer's candidate slots as a ``ScoreInput`` (a sliding layer: its last ``window - 1``)."""
    n, T = len(state.layers), state.tokens_seen
    media = torch.zeros(T, dtype=torch.bool, device=state.device)
    for item in state.media:
        media[item.start:item.end] = True
    out = []
    for i, whole in enumerate(state.layers):
        layer = attention_of(whole)  # a hybrid layer's attention part; recurrent state has no slots to evict
        if layer is None or layer.keys is None:
            continue
        keys, values, positions = layer.keys, layer.values, layer.positions
        assert values is not None and positions is not None
        held = keys.shape[2]
        # slots are the history's tail until a compression evicts some: then their tokens are unknown here
        tokens = None if layer.compressed or keys.shape[0] != 1 else torch.arange(T - held, T, device=keys.device)
        width = held if layer.window is None else min(held, layer.window - 1)  # only the window matters from here on
        if width < held:
            keys, values = keys[:, :, -width:], values[:, :, -width:]
            positions = positions[:, :, -width:] if layer.per_head else positions[:, -width:]
            tokens = None if tokens is None else tokens[-width:]
        x = ScoreInput(i, n, keys, positions, media=None if tokens is None else media[tokens], values=values,
                       tail=tail, length=T if sliding == "context" else None, limit=budget, window=layer.window,
                       per_head=layer.per_head, **_watched(seen.get(i), width, held))
        out.append(_Layer(i, layer, x, tokens, cut=width < held and trim))
    return out


def _watched(seen: Seen | None, slots: int, held: int) -> dict[str, Any]:
    """The watched inputs of a layer, cut to its last ``slots`` of ``held`` slots (a sliding window)."""
    if seen is None:
        return {}
    attention = seen.attention()

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[..., held - slots:held]

    return {"attention": cut(attention), "peak": cut(seen.peak), "reread": cut(seen.reread),
            "queries": seen.query_block(), "moments": seen.moments(), "future": seen.future, "horizon": seen.horizon,
            "scaling": seen.scaling}


def _choose(policy: Policy, layers: list[_Layer], ranking: Ranking | None, head_masks: bool,
            family: str) -> list[torch.Tensor | bool | None]:
    """Per layer: the keep mask ``[B, H, S]``, True (nothing evicted: the layer as it was), or None (no slots)."""
    masks: list[torch.Tensor | None] = [policy.choose(c.x) for c in layers]
    scores: list[torch.Tensor | None] = [None if m is not None else _per_head(policy.scores(c.x), c.x)
                                         for c, m in zip(layers, masks, strict=True)]
    if not head_masks and any(s is not None and not _same_heads(s) for s in scores):
        warnings.warn(f"kvstate: {family} attention cannot take per-head masks, so {type(policy).__name__} keeps "
                      "one slot set per layer (the most any head scores a slot)", CompressionWarning, stacklevel=4)
        scores = [None if s is None else s.amax(dim=1, keepdim=True).expand_as(s) for s in scores]
    if not head_masks and any(m is not None and not _same_heads(m) for m in masks):
        raise UnsupportedError(f"{family} attention cannot take per-head masks", found=f"{type(policy).__name__} "
                               "keeps other slots in each head", fix="give every head of a layer the same slots")
    if ranking is not None and any(s is not None for s in scores):
        ranked = [i for i, s in enumerate(scores) if s is not None]
        chosen = global_keep([scores[i] for i in ranked], [layers[i].x.valid for i in ranked],  # type: ignore[misc]
                             [layers[i].layer.window is not None for i in ranked], _ratio(policy, layers),
                             ranking.floor, ranking.sliding, ranking.count)
        for i, keep in zip(ranked, chosen, strict=True):
            masks[i] = keep
    out: list[torch.Tensor | bool | None] = []
    for c, mask, s in zip(layers, masks, scores, strict=True):
        if mask is None:
            assert s is not None
            mask = layer_keep(s, c.x.valid, policy.keep_count(c.x))
        whole = bool((mask == c.x.valid).all()) and not c.cut
        out.append(True if whole and (c.x.limit is None or c.layer.slots <= c.x.limit) else mask)
    return out


def _ratio(policy: Policy, layers: list[_Layer]) -> float:
    ratios = {policy.ratio_for(c.index, c.x.n_layers) for c in layers}
    return max(ratios) if ratios else 0.0


def _per_head(scores: torch.Tensor, x: ScoreInput) -> torch.Tensor:
    """``[B, H, S]`` float scores, ``-inf`` on padding: a ``[B, S]`` score is every head's."""
    B, H, S = x.valid.shape
    scores = scores.float()
    full = scores[:, None].expand(B, H, S) if scores.dim() == 2 else scores
    return full.masked_fill(~x.valid, float("-inf"))


def _same_heads(t: torch.Tensor) -> bool:
    return bool((t == t[:, :1]).all())


def _rebuilt(c: _Layer, keep: torch.Tensor, tokens_seen: int) -> AttentionLayerState:
    from .select import rebuild

    values = c.x.values
    assert values is not None
    return rebuild(c.layer, c.x.keys, values, c.x.positions, keep, tokens_seen, c.layer.per_head)


def _whole(c: _Layer, keep: torch.Tensor | bool | None) -> torch.Tensor:
    """Token indices every head of the layer keeps (all candidates when nothing was evicted)."""
    assert c.tokens is not None
    return c.tokens if keep is True else c.tokens[keep.all(dim=1)[0]]  # type: ignore[union-attr]


def _surviving(state: State, kept: list[torch.Tensor | None]) -> tuple[MediaItem, ...]:
    """``state.media`` marked ``kept`` where every full-attention layer (with known tokens) still holds
    all of the item's slots in every head."""
    known = [k for k in kept if k is not None]  # sorted token indices per layer
    if not state.media or not known:
        return state.media

    def whole(item: MediaItem, k: torch.Tensor) -> bool:
        return int(((k >= item.start) & (k < item.end)).sum()) == item.end - item.start

    return tuple(replace(item, kept=item.kept and all(whole(item, k) for k in known)) for item in state.media)
