"""Policies that wrap another or choose outright: budgets by depth, key re-rotation, media kept whole,
token spans kept whole (ChunkKV), and slots given by the caller (``Keep``).

A wrapper watches, ratios, ranks and scores as its inner ``policy`` does and overrides only what it
changes (kvpress's composition). ``Keep`` and ``ChunkKV`` choose the kept slots themselves
(``Policy.choose``); the others change scores or counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import InputError, UnsupportedError
from .policies import Facts, KNorm, Needs, Policy, Ranked, Ranking, ScoreInput, StreamingLLM


@dataclass(frozen=True)
class Wrapper(Policy):
    """Base of the policies that wrap another (kvpress's composition): they watch, ratio and score as
    ``policy`` does, and override only what they change."""

    policy: Policy = field(default_factory=KNorm)

    @property
    def observation_window(self) -> int:
        return self.policy.observation_window

    def needs(self) -> Needs:
        return self.policy.needs()

    def ratio_for(self, layer: int, n_layers: int) -> float:
        return self.policy.ratio_for(layer, n_layers)

    def evicts(self, n_layers: int) -> bool:
        return self.policy.evicts(n_layers)

    def ranking(self) -> Ranking | None:
        return self.policy.ranking()

    def check(self, facts: Facts) -> None:
        self.policy.check(facts)

    def choose(self, x: ScoreInput) -> torch.Tensor | None:
        return self.policy.choose(x)

    def scores(self, x: ScoreInput) -> torch.Tensor:
        return self.policy.scores(x)

    def keep_count(self, x: ScoreInput) -> int:
        return self.policy.keep_count(x)


@dataclass(frozen=True)
class PerLayerBudget(Wrapper):
    """PyramidKV-style budgets: lower layers keep more (Cai et al. 2024, arXiv:2406.02069).

    ``ratios`` gives each layer's eviction ratio explicitly; otherwise they grow
    linearly with depth from ``ratio / 2`` to ``3 ratio / 2`` (mean ``ratio``). Each layer is
    ranked alone, whatever the inner policy's own ranking.
    """

    ratios: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ratios is not None and not all(0.0 <= r < 1.0 for r in self.ratios):
            raise InputError("per-layer ratios out of range", expected="each 0 <= r < 1", found=self.ratios)

    def ratio_for(self, layer: int, n_layers: int) -> float:
        if self.ratios is not None:
            if len(self.ratios) != n_layers:
                raise InputError("one ratio per layer", expected=n_layers, found=len(self.ratios))
            return self.ratios[layer]
        depth = layer / max(n_layers - 1, 1)
        return min(self.ratio * (0.5 + depth), 0.95)

    def evicts(self, n_layers: int) -> bool:
        return any(self.ratio_for(i, n_layers) > 0 for i in range(n_layers))

    def ranking(self) -> Ranking | None:
        return None

    def keep_count(self, x: ScoreInput) -> int:
        return Policy.keep_count(self, x)


@dataclass(frozen=True)
class ReRotate(Wrapper):
    """Move retained keys to contiguous positions by re-applying RoPE by the position delta.

    Opt-in: the new tokens then continue at position ``S`` (the retained count), as in
    StreamingLLM's position shifting, instead of at the true logical position. Needs every
    head of a layer to keep the same slots.
    """

    policy: Policy = field(default_factory=StreamingLLM)

    def check(self, facts: Facts) -> None:
        super().check(facts)
        inner = self.policy
        if isinstance(inner, Ranked) and (inner.heads or inner.scope == "global"):
            raise UnsupportedError("ReRotate needs every head of every layer to keep as many slots",
                                   found=f"{type(inner).__name__}(heads={inner.heads}, scope={inner.scope!r})",
                                   fix=f"ReRotate(policy={type(inner).__name__}(..., heads=False, scope='layer'))")


@dataclass(frozen=True)
class MediaSpans(Wrapper):
    """Images and videos kept or dropped whole (media state), the rest scored by ``policy``.

    ``keep=True``: no media slot is evicted; ``policy`` evicts its ratio from the other slots (a
    layer keeps at least its media). ``keep=False``: every media slot is evicted, plus what
    ``policy`` picks among the text slots to reach its ratio. Needs layers whose slots still map
    to tokens (not compressed before): ``state.media`` then records which items survived.
    """

    keep: bool = True

    def keep_count(self, x: ScoreInput) -> int:
        media = int(_media(x, self).sum())
        k = self.policy.keep_count(x)
        return max(k, media) if self.keep else min(k, x.keys.shape[2] - media)

    def scores(self, x: ScoreInput) -> torch.Tensor:
        scores = self.policy.scores(x).float().clone()
        scores[..., _media(x, self)] = float("inf") if self.keep else float("-inf")
        return scores


def _media(x: ScoreInput, policy: Policy) -> torch.Tensor:
    if x.media is None:
        raise InputError(f"{type(policy).__name__} needs to know which slots hold media",
                         expected="attention layers whose slots still map to tokens", found="a layer compressed "
                         "before", fix="apply MediaSpans as the first compression of a state")
    return x.media


@dataclass(frozen=True)
class ChunkKV(Wrapper):
    """Keep or drop spans of ``chunk`` slots whole, ranked by ``policy``'s scores (Liu et al. 2025,
    "ChunkKV", arXiv:2502.00299), as kvpress computes it.

    A span scores the sum over heads of the inner scores, averaged over its slots; each layer keeps
    its ``max(1, int(spans * (1 - ratio)))`` best spans, in every head (a layer is ranked alone).
    Infinite inner scores (sinks, kept media) count as the largest finite score, so they weigh but do
    not make every span they touch tie.
    """

    chunk: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise InputError("invalid ChunkKV span", expected="an int >= 1", found=repr(self.chunk)[:40])

    def ranking(self) -> Ranking | None:
        return None

    def choose(self, x: ScoreInput) -> torch.Tensor | None:
        valid = x.valid  # [B, H, S]
        B, H, S = valid.shape
        raw = self.policy.scores(x).float()
        raw = raw[:, None].expand(B, H, S) if raw.dim() == 2 else raw
        finite = raw.masked_fill(~torch.isfinite(raw), float("-inf"))
        top = finite.amax().clamp_min(0.0) if bool(torch.isfinite(finite).any()) else torch.tensor(0.0)
        scores = torch.nan_to_num(raw, posinf=float(top), neginf=0.0).masked_fill(~valid, 0.0).sum(dim=1)  # [B, S]
        spans = (S + self.chunk - 1) // self.chunk
        padded = torch.nn.functional.pad(scores, (0, spans * self.chunk - S))
        counts = torch.full((spans,), self.chunk, device=scores.device)
        counts[-1] = S - (spans - 1) * self.chunk
        span_scores = padded.view(B, spans, self.chunk).sum(-1) / counts  # [B, spans]
        kept_spans = max(1, int(spans * (1 - self.ratio_for(x.layer, x.n_layers))))
        if x.limit is not None:
            kept_spans = max(1, min(spans, x.limit // self.chunk))
        top_spans = span_scores.topk(min(kept_spans, spans), dim=-1).indices  # [B, k]
        keep = torch.zeros(B, spans, dtype=torch.bool, device=scores.device)
        keep.scatter_(1, top_spans, True)
        return keep.repeat_interleave(self.chunk, dim=1)[:, None, :S].expand(B, H, S) & valid


@dataclass(frozen=True, init=False)
class Keep(Policy):
    """Keep exactly the given slots: ``slots`` maps a decoder layer index to one sequence of kept slot
    indices per KV head (``[[head 0 slots], [head 1 slots], ...]``, batch of one). Layers not named are
    kept whole. For cross-checks against another library's choices (e.g. kvpress's masked key indices).

    Slot ``j`` is the layer's ``j``-th stored slot: token ``j`` of an uncompressed full-attention layer.
    """

    slots: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...] = ()

    def __init__(self, slots: Mapping[int, Sequence[Sequence[int]]]) -> None:
        object.__setattr__(self, "ratio", 0.0)
        object.__setattr__(self, "slots", _frozen_slots(slots))

    def evicts(self, n_layers: int) -> bool:
        return bool(self.slots)

    def choose(self, x: ScoreInput) -> torch.Tensor | None:
        given = dict(self.slots).get(x.layer)
        valid = x.valid
        B, H, S = valid.shape
        if given is None:
            return valid
        if B != 1 or len(given) != H or any(not 0 <= j < S for head in given for j in head):
            raise InputError(f"Keep: layer {x.layer} holds {H} KV heads of {S} slots (batch {B})",
                             expected=f"batch 1, {H} sequences of slot indices in 0..{S - 1}",
                             found=f"{len(given)} sequences" + ("" if B == 1 else f", batch {B}"),
                             fix="one list of kept slot indices per KV head of that layer")
        keep = torch.zeros(B, H, S, dtype=torch.bool, device=valid.device)
        for h, head in enumerate(given):
            keep[0, h, list(head)] = True
        return keep & valid


def _frozen_slots(slots: Mapping[int, Sequence[Sequence[int]]]) -> tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]:
    if not isinstance(slots, Mapping) or not slots:
        raise InputError("Keep takes the kept slots per layer", expected="{layer: [[slots of head 0], ...]}",
                         found=type(slots).__name__, fix="Keep({2: [[0, 1, 5], [0, 3, 4]]})")
    out = []
    for layer, heads in sorted(slots.items()):
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0 or isinstance(heads, (str, bytes)):
            raise InputError("Keep: a layer index must be an int >= 0 with a list of heads", found=repr(layer)[:40])
        rows = tuple(tuple(sorted({int(j) for j in head})) for head in heads)
        out.append((layer, rows))
    return tuple(out)
