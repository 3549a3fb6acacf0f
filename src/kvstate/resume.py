"""Resume planning, as pure functions: which prefix of a state a request can keep.

``plan(state, ids, mask, spans)`` compares a request's full history ``ids`` ``[B, L]``
(and its padding ``mask``) with the tokens a state has processed, and says how
many of them to keep and how many to feed before the first new token. It touches
no model and changes nothing, so it is tested on toy states. The rules:

* keep the longest common prefix, never splitting a multimodal item (``spans``), and
  ending before the first media item whose content differs from what the state
  processed (``media``: same placeholders, other pixels must never reuse stale K/V);
* if the whole history is processed and the state holds its last logits, feed
  nothing (``stored-logits``: the first forward of ``generate`` is memoized);
* otherwise feed at least one token: cut the state back where every layer allows
  (``rollback``), else to the latest checkpoint that fits (``checkpoint``), else
  start over (``recompute``). A token is never processed twice.

``start_state`` applies a plan (a pure ``State`` operation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .state import MediaItem, State

MODES = ("continue", "rollback", "checkpoint", "recompute", "stored-logits")


@dataclass(frozen=True)
class ResumePlan:
    """How a call uses a state.

    ``reused`` slots come from the state (``source`` ``"state"``, or ``"store"`` for a
    prefix loaded from a ``PrefixStore``); ``fed`` slots go through the model before
    the first new token; ``mode`` is one of ``MODES``.
    """

    reused: int
    fed: int
    mode: str
    source: str = "state"


def common_prefix(state: State, ids: torch.Tensor, mask: torch.Tensor) -> int:
    """Longest prefix (in slots) on which the state and the request agree for every row: same
    padding, same tokens, and (1-D positions) the positions a fresh run gives the history.
    ``generate`` numbers a token that follows a trailing pad from that pad's position 0, so
    such a slot is processed at a position no fresh run of a longer history gives it. A state
    renumbered by ``ReRotate`` (evicted slots at -1) continues its own frame, unchecked."""
    n = min(state.tokens_seen, ids.shape[1])
    same_mask = state.mask[:, :n] == mask[:, :n]
    same_tok = (state.tokens[:, :n] == ids[:, :n]) | ~mask[:, :n]
    if state.positions.dim() == 2 and not bool((state.positions[:, :n] < 0).any()):
        fresh = mask[:, :n].long().cumsum(-1) - 1
        same_tok &= (state.positions[:, :n].to(fresh.device) == fresh) | ~mask[:, :n]
    agree = (same_mask & same_tok).all(dim=0)
    bad = (~agree).nonzero()
    return int(bad[0]) if bad.numel() else n


def media_prefix(state: State, media: Sequence[MediaItem] | None) -> int:
    """Slots before the first item of the history's ``media`` that the state holds other
    content for (or holds without a record, as in files written before media hashes).
    ``None`` (the caller passed no pixels for processed media) trusts the placeholders."""
    if media is None:
        return state.tokens_seen
    held = {m.key for m in state.media}
    for item in sorted(media, key=lambda m: m.start):
        if item.start < state.tokens_seen and item.key not in held:
            return item.start
    return state.tokens_seen


def safe_point(n: int, spans: Sequence[tuple[int, int]]) -> int:
    """The largest ``m <= n`` that does not fall inside a ``[start, end)`` span."""
    for start, end in sorted(spans, reverse=True):
        if start < n < end:
            n = start
    return n


def plan(state: State, ids: torch.Tensor, mask: torch.Tensor,
         spans: Sequence[tuple[int, int]] = (), source: str = "state", rollback: bool = True,
         media: Sequence[MediaItem] | None = None) -> ResumePlan:
    """How to continue the history ``ids`` ``[B, L]`` from ``state`` (see the module docstring).

    ``rollback=False`` (a model whose state is not all in the cache): only continuing or
    re-feeding from scratch is allowed. ``media``: the history's media items with their
    content hashes, when the caller passed every item's pixels.
    """
    T, L = state.tokens_seen, ids.shape[1]
    spans = (*spans, *((m.start, m.end) for m in state.media))  # what the state processed as one item
    shared = safe_point(min(common_prefix(state, ids, mask), media_prefix(state, media)), spans)
    if shared == T == L and state.last_logits is not None:
        return ResumePlan(T, 0, "stored-logits", source)
    target = safe_point(min(shared, L - 1), spans)
    if target == T:
        return ResumePlan(T, L - T, "continue", source)
    if not rollback:
        return ResumePlan(0, L, "recompute", source)
    if not state.rollback_limit(target):
        uses_checkpoint = any(layer.rollback_limit(target) for layer in state.layers)
        return ResumePlan(target, L - target, "checkpoint" if uses_checkpoint else "rollback", source)
    for checkpoint in reversed(state.checkpoints):
        n = checkpoint.tokens_seen
        if n <= target and safe_point(n, spans) == n and not state.rollback_limit(n):
            return ResumePlan(n, L - n, "checkpoint", source)
    return ResumePlan(0, L, "recompute", source)


def best(plans: Sequence[ResumePlan]) -> ResumePlan:
    """The plan that reuses most (the first wins ties, so the session's own state beats a store)."""
    return max(plans, key=lambda p: (p.reused, p.mode == "stored-logits"))


def start_state(state: State, resume: ResumePlan, empty: State) -> State:
    """The state the engine starts from: ``state`` cut to ``resume.reused``, or ``empty``."""
    if resume.mode == "recompute":
        return empty
    return state.truncated(resume.reused)
