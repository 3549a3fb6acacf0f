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
  start over (``recompute``). A token is never processed twice;
* under the canonical schedule (``kvstate.schedule``) the kept prefix also
  ends at a cut of the schedule within the state's canonical slots, so every slot fed
  from there is computed as the cold run computes it (``realign`` when that is the only
  reason to cut back); the stored logits are used only when they are canonical.

``choose`` asks each source in turn (the session's own state first, then the
server's pool and the prefix store) and keeps the plan that reuses most.
``start_state`` applies a plan (a pure ``State`` operation). ``settle_span`` plans the
re-feed that makes a decoded answer canonical (``Session.settle``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from .errors import StoreWarning
from .schedule import Canonical
from .state import MediaItem, State

if TYPE_CHECKING:
    from .protocols import PrefixQuery, StateSink, StateSource
    from .request import Request

MODES = ("continue", "realign", "rollback", "checkpoint", "recompute", "stored-logits")
_OFF = Canonical(0)


@dataclass(frozen=True)
class ResumePlan:
    """How a call uses a state.

    ``reused`` slots come from the state (``source`` ``"state"``, or ``"store"`` for a
    prefix loaded from a ``PrefixStore``); ``fed`` slots go through the model before
    the first new token; ``mode`` is one of ``MODES``. ``start`` is the state the engine
    starts from (the source's state cut to ``reused``; set by ``choose``).
    """

    reused: int
    fed: int
    mode: str
    source: str = "state"
    start: State | None = field(default=None, repr=False, compare=False)
    note: str = field(default="", compare=False)  # why a source's slots could not be reused (``schedule_note``)

    def __repr__(self) -> str:
        note = f", note={self.note!r}" if self.note else ""
        return f"ResumePlan(reused={self.reused}, fed={self.fed}, mode={self.mode!r}, source={self.source!r}{note})"


def common_prefix(state: State, ids: torch.Tensor, mask: torch.Tensor) -> int:
    """Longest prefix (in slots) on which the state and the request agree for every row."""
    n = min(state.tokens_seen, ids.shape[1])
    if state.batch_size != ids.shape[0]:
        return 0
    same_mask = state.mask[:, :n] == mask[:, :n]
    same_tok = (state.tokens[:, :n] == ids[:, :n]) | ~mask[:, :n]
    agree = (same_mask & same_tok).all(dim=0)
    bad = (~agree).nonzero()
    return int(bad[0]) if bad.numel() else n


def shared_prefix(state: State, tokens: torch.Tensor, media: Sequence[tuple[int, str]]) -> int:
    """Slots a single-row, unpadded history ``tokens`` ``[1, L]`` shares with ``state``: the common
    prefix, ending before the first media item (``(start, content hash)``) the state holds other
    content for. How a pool ranks its states (``kvstate.serve.pool``)."""
    n = common_prefix(state, tokens.to(state.device), torch.ones_like(tokens, dtype=torch.bool, device=state.device))
    held = {(m.start, m.digest) for m in state.media}
    for start, digest in sorted(media):
        if start < n and (start, digest) not in held:
            return start
    return n


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
         media: Sequence[MediaItem] | None = None, schedule: Canonical = _OFF) -> ResumePlan:
    """How to continue the history ``ids`` ``[B, L]`` from ``state`` (see the module docstring).

    ``rollback=False`` (a model whose state is not all in the cache): only continuing or
    re-feeding from scratch is allowed. ``media``: the history's media items with their
    content hashes, when the caller passed every item's pixels. ``schedule``: the canonical
    schedule (off by default here; ``Session`` turns it on).
    """
    T, L = state.tokens_seen, ids.shape[1]
    spans = (*spans, *((m.start, m.end) for m in state.media))  # what the state processed as one item
    shared = safe_point(min(common_prefix(state, ids, mask), media_prefix(state, media)), spans)
    canonical = schedule.enabled and not state.is_compressed
    if shared == T == L and state.last_logits is not None and (
            not canonical or state.canonical_logits(schedule.chunk, schedule.device, schedule.marks)):
        return ResumePlan(T, 0, "stored-logits", source)
    target = safe_point(min(shared, L - 1), spans)
    history = ids[0] if schedule.marks else None  # turn marks: a batch's rows hold no canonical slots
    note = ""
    if canonical:  # a cut of the schedule, within the slots the cold run computed the same way
        kept = state.canonical_for(schedule.chunk, schedule.device, schedule.marks)
        cut = shared_cut(schedule, state, min(target, kept), kept, spans, history)
        if media is None and any(cut <= a < T for a, _ in spans):
            # re-feeding a processed image needs its pixels, which this request did not pass (and a cold
            # run would need): trust the placeholders and continue, exact to float32 rounding only
            canonical = False
        else:
            note = schedule_note(state, schedule) if cut < target and not kept else ""
            target = cut
    if target == T:
        return ResumePlan(T, L - T, "continue", source, note=note)
    if not rollback:
        return ResumePlan(0, L, "recompute", source, note=note)
    if not state.rollback_limit(target):
        uses_checkpoint = any(layer.rollback_limit(target) for layer in state.layers)
        cut_only_for_schedule = canonical and min(shared, L - 1) >= T
        mode = "checkpoint" if uses_checkpoint else "realign" if cut_only_for_schedule else "rollback"
        return ResumePlan(target, L - target, mode, source, note=note)
    for checkpoint in reversed(state.checkpoints):
        n = checkpoint.tokens_seen
        on_cut = not canonical or schedule.last_cut(n, spans, history) == n
        if n <= target and on_cut and safe_point(n, spans) == n and not state.rollback_limit(n):
            return ResumePlan(n, L - n, "checkpoint", source, note=note)
    return ResumePlan(0, L, "recompute", source, note=note)


def schedule_note(state: State, schedule: Canonical) -> str:
    """Why ``state``'s slots are not canonical under ``schedule``: it was fed under another schedule or kernels."""
    if not state.canonical:
        return ("its slots were fed off the canonical schedule (canonical_chunk=0): none is the cold run's under "
                f"canonical_chunk={schedule.chunk}")
    return (f"its {state.canonical} canonical slots were fed with canonical_chunk={state.canonical_chunk} on "
            f"{state.canonical_device or 'unknown kernels'}, not canonical_chunk={schedule.chunk} on {schedule.device}")


def choose(sources: Sequence[tuple[str, StateSource]], request: Request, empty: State, *, rollback: bool,
           schedule: Canonical, adopt: Callable[[State], State]) -> ResumePlan:
    """The plan that reuses most over ``sources`` (the session's own state first: it wins ties).

    Each source after the first is asked only for a state longer than the best plan so far
    reuses; ``adopt`` checks (and moves) a state a source hands out. The chosen plan carries
    its ``start`` state: the source's state cut to the plan, or ``empty`` to start over.
    """
    best_plan, best_state = None, empty
    at_most = request.ids.shape[1]
    notes: list[str] = []  # why a source's slots were not reusable, for the caller (``ResumePlan.note``)
    for name, source in sources:
        longer_than = -1 if best_plan is None else best_plan.reused
        found = source.lookup(request.query, longer_than=longer_than, at_most=at_most)  # type: ignore[arg-type]
        if found is None:
            continue
        state = found if best_plan is None else adopt(found)
        candidate = plan(state, request.ids, request.mask, request.spans, name, rollback, request.media, schedule)
        if candidate.note:
            notes.append(f"{name}: {candidate.note}")
        if best_plan is None or (candidate.reused, candidate.mode == "stored-logits") > (
                best_plan.reused, best_plan.mode == "stored-logits"):
            best_plan, best_state = candidate, state
    assert best_plan is not None, "the session's own state always answers"
    return replace(best_plan, start=start_state(best_state, best_plan, empty), note="; ".join(notes))


def best(plans: Sequence[ResumePlan]) -> ResumePlan:
    """The plan that reuses most (the first wins ties, so the session's own state beats a store)."""
    return max(plans, key=lambda p: (p.reused, p.mode == "stored-logits"))


def start_state(state: State, resume: ResumePlan, empty: State) -> State:
    """The state the engine starts from: ``state`` cut to ``resume.reused``, or ``empty``."""
    if resume.mode == "recompute":
        return empty
    return state.truncated(resume.reused)


def shared_cut(schedule: Canonical, state: State, limit: int, kept: int, spans: Sequence[tuple[int, int]],
               history: torch.Tensor | None) -> int:
    """The largest cut ``<= limit`` of ``history`` (``[L]``, the new history) at which ``state``'s canonical feed
    also ended a chunk: a cut of the state's own history, or ``kept``, where its canonical feed ended. Under marks
    a cut is decided by the token at it (a line) or after it (a turn mark), so a history that leaves the state's
    right there can cut where the state's chunk ran on: those slots are not the new cold run's."""
    cut = schedule.last_cut(limit, spans, history)
    if history is None or not schedule.marks:  # cuts at multiples of C: the same for every history
        return cut
    own = state.tokens[0]
    while cut and cut != kept and schedule.last_cut(cut, spans, own) != cut:
        cut = schedule.last_cut(cut - 1, spans, history)
    return cut


def settle_span(state: State, schedule: Canonical, through: torch.Tensor | None = None) -> tuple[int, int] | None:
    """The slots ``[start, end)`` that ``Session.settle`` feeds in canonical chunks (the canonical schedule): from the
    end of the state's canonical prefix to its last cut, or, given ``through`` (text ids ``[L]`` the next
    turn will begin with, a turn mark or a line following them), to ``L`` (under prompt marks, to the last cut
    those ids decide: ``Canonical.settled_end``). None when nothing is to do or it is not
    possible: the schedule is off, a batch, padding, compression, an image in the way (its pixels are
    gone), or no way back to ``start``."""
    if not schedule.enabled or state.batch_size != 1 or state.is_compressed or not bool(state.mask.all()):
        return None
    spans = tuple((m.start, m.end) for m in state.media)
    history = state.tokens[0] if through is None else through
    shared = common_prefix(state, history[None], torch.ones_like(history[None], dtype=torch.bool))
    canonical = state.canonical_for(schedule.chunk, schedule.device, schedule.marks)
    start = shared_cut(schedule, state, min(canonical, shared), canonical, spans, history)
    end = schedule.last_cut(history.shape[0], spans, history) if through is None else \
        schedule.settled_end(history.shape[0], spans, history)
    if end <= start or any(start <= a < end for a, _ in spans) or state.rollback_limit(start):
        return None
    return start, end


def offer(sinks: Sequence[StateSink], states: tuple[State, State], query: PrefixQuery,
          seconds_per_token: float) -> None:
    """Offer ``states`` (the prompt's, the conversation's) to every sink; a failing sink costs a ``StoreWarning``,
    never the answer, which is already computed."""
    for sink in sinks:
        try:
            sink.offer(states, query, seconds_per_token)
        except Exception as exc:
            warnings.warn(f"kvstate: prefix store write failed: {type(exc).__name__}: {exc}", StoreWarning,
                          stacklevel=4)


class Own:
    """A session's own state, as source 0 (it answers every query with itself)."""

    def __init__(self, state: State) -> None:
        self.state = state

    def lookup(self, query: PrefixQuery | None, *, longer_than: int, at_most: int) -> State | None:
        return self.state


class Guarded:
    """A source whose failure is a miss with a ``StoreWarning`` (a cache that cannot be read is a miss)."""

    def __init__(self, source: StateSource) -> None:
        self.source = source

    def lookup(self, query: PrefixQuery, *, longer_than: int, at_most: int) -> State | None:
        try:
            return self.source.lookup(query, longer_than=longer_than, at_most=at_most)
        except Exception as exc:
            warnings.warn(f"kvstate: prefix store read failed, continuing without it: {type(exc).__name__}: {exc}",
                          StoreWarning, stacklevel=4)
            return None
