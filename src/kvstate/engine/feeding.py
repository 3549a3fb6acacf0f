"""One feed's chunks, one at a time: ``Engine._run_feed`` runs one feed's, ``Engine.feed_many`` the feeds of
many conversations in lockstep, so the chunks of one round can share a tiled forward (issue 25).

A ``FeedRun`` plans each chunk (``chunk``: its ids, mask, positions, inputs, and whether its logits
are needed) and takes the state after it (``advance``), marking the slots the canonical schedule
made canonical and taking checkpoints at its cuts (issue 23). Which forward computed a chunk is the
engine's business; the label of its kernels (``kernels_label``) goes into the state with the
canonical count, so a resume reuses only slots computed on the same kernels.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..schedule import Canonical
from ..state import State
from .values import Feed, FeedSettings

if TYPE_CHECKING:
    from ..protocols import ModelInputs
    from .core import Engine

Chunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "ModelInputs", bool]


class FeedRun:
    """The chunks of ``feed`` after ``state`` (see the module docstring); ``state`` is the latest state."""

    def __init__(self, engine: Engine, state: State, feed: Feed, settings: FeedSettings, chunk_size: int) -> None:
        self.engine, self.state, self.feed, self.settings, self.chunk_size = engine, state, feed, settings, chunk_size
        self.T, self.Q = state.tokens_seen, feed.ids.shape[1]
        self.schedule = Canonical(settings.canonical, marks=settings.marks)
        self.history = engine._history(state, feed.ids, settings)
        self.spans = (*((m.start, m.end) for m in state.media), *feed.spans)
        self.ends = engine._canonical_ends(state, feed.ids, settings, self.schedule, self.history, self.spans)
        self.checkpointed = any(layer.checkpointed for layer in state.layers)
        self.label = engine.kernels(state.batch_size, settings)
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
            size = self.engine._chunk(self.state, Q - start, self.settings, self.chunk_size, bool(feed.inputs),
                                      self.checkpointed)
            self.end = min(start + size, Q)
        end = self.end
        inputs = feed.inputs if self.ends is None else self.engine._chunk_inputs(feed, start, end)
        return feed.ids[:, start:end], feed.mask[:, :T + end], feed.positions[:, start:end], inputs, end >= Q

    def advance(self, state: State) -> None:
        """Take ``state``, the state after the chunk ``chunk`` planned."""
        start, end, T, Q, settings, schedule = self.start, self.end, self.T, self.Q, self.settings, self.schedule
        if self.ends is not None:  # every slot so far is the cold run's (issue 23); the last chunk's, unless
            # the history ends inside an incomplete turn mark
            self.ends.pop(0)
            kept = schedule.keeps(T + start, T + end, self.history) if end >= Q else T + end
            state = replace(state, canonical=kept, canonical_chunk=settings.canonical,
                            canonical_device=self.label, canonical_marks=settings.marks)
        every = settings.checkpoint_every
        # at every cut, the feed's end too when it is one whatever follows: a resume restarts there
        cut = self.ends is not None and (end < Q or schedule.last_cut(T + end, self.spans, self.history) == T + end)
        if self.checkpointed and (cut or (end < Q and every and state.tokens_seen % every == 0)):
            state = state.with_checkpoint(settings.max_checkpoints)
        self.state, self.start = state, end
