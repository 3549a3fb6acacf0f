"""Prompts admitted in later steps share their common prefix (continuous batching): a system prompt that many
requests start with is computed once (the scheduler holds a prompt that shares a whole chunk with one
admitted in the same step until the next step, so it finds that one here).

``RecentPrompts`` keeps the prefilled states of a scheduler's last admissions and hands them to
the next admissions as a prefix source (``kvstate.protocols.PrefixCache``), ranked as the server's
pool ranks its states. A resume from one restarts at the canonical schedule's last cut
(``docs/exactness.md``), so an answer that reused a neighbour's prefix is bit for bit the answer
computed cold, alone. States are immutable: sharing one is copy-on-write for free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ..protocols import PrefixQuery
from ..resume import shared_prefix
from ..state import State


class RecentPrompts:
    """The last ``keep`` prompt states offered, as a prefix source and sink."""

    name = "batch"

    def __init__(self, keep: int) -> None:
        self._states: deque[State] = deque(maxlen=keep)

    def lookup(self, query: PrefixQuery, *, longer_than: int, at_most: int) -> State | None:
        """The state sharing the most leading slots with ``query`` (canonical ones first), if more than
        ``longer_than``."""
        best, rank = None, (0, 0)
        for state in self._states:
            if state.fingerprint != query.fingerprint:
                continue
            n = min(shared_prefix(state, query.tokens, query.media), at_most)
            usable = min(n, state.canonical) if state.canonical_chunk else n  # what a resume may keep
            if n > longer_than and (usable, n) > rank:
                best, rank = state, (usable, n)
        return best

    def offer(self, states: Sequence[State], query: PrefixQuery, seconds_per_token: float = 0.0) -> int:
        """Keep the first of ``states`` (the prompt's): one row, unpadded, not kept already."""
        state = states[0] if states else None
        if state is None or state.batch_size != 1 or not bool(state.mask.all()) or \
                any(kept is state for kept in self._states):
            return 0
        self._states.append(state)
        return 1
