"""One feed's chunks, one at a time: ``Engine._run_feed`` runs one feed's, ``Engine.feed_many`` the feeds of
many conversations in lockstep, so the chunks of one round can share a tiled forward (continuous batching).

A ``FeedRun`` plans each chunk (``chunk``: its ids, mask, positions, inputs, and whether its logits
are needed) and takes the state after it (``advance``), marking the slots the canonical schedule
made canonical and taking checkpoints at its cuts (the canonical schedule). Which forward computed a chunk is the
engine's business; the label of its kernels (``Engine.kernels``) goes into the state with the
canonical count, so a resume reuses only slots computed on the same kernels. Everything here is
planning: no forward runs in this module.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..request import Feed
from ..schedule import Canonical
from ..settings import Settings
from ..state import State

if TYPE_CHECKING:
    from ..adapters.binding import Binding
    from ..protocols import ModelInputs

Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "ModelInputs", bool]


class FeedRun:
    """The chunks of ``feed`` after ``state`` (see the module docstring); ``state`` is the latest state."""

    def __init__(self, binding: Binding, state: State, feed: Feed, settings: Settings, chunk_size: int,
                 label: str, logits: bool = True) -> None:
        self.binding, self.state, self.feed, self.settings, self.chunk_size = binding, state, feed, settings, chunk_size
        self.logits = logits  # False: the last chunk skips the output head too (a settle: the next call feeds on)
        self.T, self.Q = state.tokens_seen, feed.ids.shape[1]
        self.schedule = Canonical(settings.canonical_chunk, marks=settings.canonical_marks)
        self.history = history(state, feed.ids, settings)
        self.spans = (*((m.start, m.end) for m in state.media), *feed.spans)
        self.ends = canonical_ends(binding, state, feed.ids, settings, self.schedule, self.history, self.spans, label)
        self.checkpointed = any(layer.checkpointed for layer in state.layers)
        self.label = label  # the kernels the engine runs this feed's chunks on (``Engine.kernels``)
        self.start = self.end = 0

    @property
    def done(self) -> bool:
        return self.start >= self.Q

    def chunk(self) -> Chunk:
        """The next chunk: ids ``[B, q]``, mask ``[B, T + end]``, positions ``[B, q(, R)]``, its model inputs, and
        whether it is the feed's last (whose logits the state keeps)."""
        feed, start, T, Q = self.feed, self.start, self.T, self.Q
        if self.ends is not None:
            self.end = self.ends[0] - T
        else:
            size = self._size(Q - start)
            self.end = min(start + size, Q)
        end = self.end
        inputs = feed.inputs if self.ends is None else self._inputs(start, end)
        last = end >= Q and self.logits
        return feed.ids[:, start:end], feed.mask[:, :T + end], feed.positions[:, start:end], inputs, last

    def _size(self, remaining: int) -> int:
        """Tokens in the next forward off the schedule: stepwise families continue one token at a time; media
        go in whole; chunks end on checkpoint boundaries."""
        state, every = self.state, self.settings.checkpoint_every
        if self.binding.caps.stepwise and not state.is_empty:
            return 1
        size = remaining if self.feed.inputs else self.chunk_size
        if every and self.checkpointed:
            size = min(size, every - state.tokens_seen % every)
        return size

    def _inputs(self, start: int, end: int) -> ModelInputs:
        """The model inputs of the media items in the feed's slots ``[start, end)`` (chunks never split one)."""
        feed = self.feed
        if not feed.inputs:
            return feed.inputs
        inputs = self.binding.inputs.select(feed.ids, start, feed.inputs)
        return self.binding.inputs.until(feed.ids[:, start:], end - start, inputs)

    def advance(self, state: State) -> None:
        """Take ``state``, the state after the chunk ``chunk`` planned."""
        start, end, T, Q, settings, schedule = self.start, self.end, self.T, self.Q, self.settings, self.schedule
        if self.ends is not None:  # every slot so far is the cold run's; the last chunk's, unless
            # the history ends inside an incomplete turn mark
            self.ends.pop(0)
            kept = schedule.keeps(T + start, T + end, self.history) if end >= Q else T + end
            state = replace(state, canonical=kept, canonical_chunk=settings.canonical_chunk,
                            canonical_device=self.label, canonical_marks=settings.canonical_marks)
        every = settings.checkpoint_every
        # at every cut, the feed's end too when it is one whatever follows: a resume restarts there
        cut = self.ends is not None and (end < Q or schedule.last_cut(T + end, self.spans, self.history) == T + end)
        if self.checkpointed and (cut or (end < Q and every and state.tokens_seen % every == 0)):
            state = state.with_checkpoint(settings.max_checkpoints)
        self.state, self.start = state, end


def canonical_ends(binding: Binding, state: State, ids: torch.Tensor, settings: Settings, schedule: Canonical,
                   history: torch.Tensor | None, spans: tuple[tuple[int, int], ...], label: str) -> list[int] | None:
    """The chunk ends (absolute) of a feed of ``ids`` ``[B, Q]`` after ``state`` under the canonical ``schedule``,
    on the kernels ``label``; None when the schedule does not apply: it is off, the family feeds one token per
    forward, or the feed starts off a canonical cut (of these kernels)."""
    if not schedule.enabled or binding.caps.stepwise or state.is_compressed:
        return None
    if settings.canonical_marks and ids.shape[0] != 1:  # one row's marks are not another's
        return None
    T = state.tokens_seen
    if T and (state.canonical_for(settings.canonical_chunk, label, settings.canonical_marks) != T
              or schedule.last_cut(T, spans, history) != T):
        return None
    return schedule.cuts(T, T + ids.shape[1], spans, history)


def history(state: State, ids: torch.Tensor, settings: Settings) -> torch.Tensor | None:
    """The ids ``[L]`` the turn marks are found in (row 0), or None without marks."""
    if not settings.canonical_marks:
        return None
    return torch.cat([state.tokens[0], ids[0]])
