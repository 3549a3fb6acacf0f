"""An in-memory pool of recent conversation states: least recently used first out, under a byte budget.

Each API key's states live in its own namespace; a lookup never sees another
namespace. The pool is a prefix source and sink like a ``PrefixStore``
(``StatePool.source(namespace)``): it hands ``kvstate.resume`` the state sharing the
longest prefix with a query (tokens, and media by content), which plans over it like
over any other source. States are immutable, so one pooled state can start several
requests (a regenerated answer, two branches of one chat) without copies. A state
whose tokens are a prefix of a newer one is dropped when the newer one can serve
every request the old one could (it rolls back there, and holds as many canonical slots).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from threading import Lock

from ..protocols import PrefixQuery
from ..resume import shared_prefix
from ..state import State


class StatePool:
    """Recent states by ``(namespace, id)``; ``max_bytes`` bounds the sum of ``state.nbytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._states: OrderedDict[tuple[str, int], State] = OrderedDict()
        self._next = 0
        self._lock = Lock()  # the worker writes, /metrics reads

    def source(self, namespace: str, marks: tuple[int, ...] | None = None) -> PoolSource:
        """The pool as one namespace's ``PrefixCache`` (``Session(sources=[...])``) for sessions whose canonical
        schedule has ``marks`` (None: any)."""
        return PoolSource(self, namespace, marks)

    def longest(self, namespace: str, query: PrefixQuery, at_most: int,
                marks: tuple[int, ...] | None = None) -> tuple[State | None, int]:
        """The state of ``namespace`` made by ``query.fingerprint`` sharing the longest prefix (at most
        ``at_most`` slots) with ``query``, and that length. Under the canonical schedule, states fed with
        ``marks`` (when given) come first: a resume keeps none of another schedule's slots."""
        with self._lock:
            candidates = [(key, s) for key, s in self._states.items() if key[0] == namespace
                          and s.fingerprint == query.fingerprint]
        best: tuple[tuple[str, int] | None, State | None, int] = (None, None, 0)
        best_rank = (0, 0)
        for key, state in candidates:
            n = min(shared_prefix(state, query.tokens, query.media), at_most)
            # under the canonical schedule a resume keeps at most the state's canonical slots: a settled state
            # (kvstate.Session.settle) beats a longer one whose answer was decoded one token per forward
            usable = min(n, state.canonical) if state.canonical_chunk else n
            if state.canonical_chunk and marks is not None and state.canonical_marks != marks:
                usable = 0
            if (usable, n) > best_rank:
                best, best_rank = (key, state, n), (usable, n)
        if best[0] is not None:
            with self._lock:
                if best[0] in self._states:
                    self._states.move_to_end(best[0])
        return best[1], best[2]

    def put(self, namespace: str, state: State) -> None:
        """Add ``state`` (one row, no padding), drop the states it covers, then evict down to the budget."""
        if state.batch_size != 1 or state.is_empty or not bool(state.mask.all()):
            return
        with self._lock:
            for key, old in list(self._states.items()):
                if key[0] == namespace and _covers(state, old):
                    del self._states[key]
            self._states[(namespace, self._next)] = state
            self._next += 1
            while self._states and self.nbytes > self.max_bytes:
                self._states.popitem(last=False)

    def holds(self, namespace: str, state: State) -> bool:
        """Whether ``state`` itself is still pooled (not covered by a newer state, nor evicted)."""
        with self._lock:
            return any(s is state for (ns, _), s in self._states.items() if ns == namespace)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._states.values())

    def __len__(self) -> int:
        return len(self._states)


class PoolSource:
    """One namespace of a ``StatePool``, as a prefix source and sink (``kvstate.protocols.PrefixCache``)."""

    name = "pool"

    def __init__(self, pool: StatePool, namespace: str, marks: tuple[int, ...] | None = None) -> None:
        self.pool, self.namespace, self.marks = pool, namespace, marks

    def lookup(self, query: PrefixQuery, *, longer_than: int, at_most: int) -> State | None:
        state, n = self.pool.longest(self.namespace, query, at_most, self.marks)
        return state if n > longer_than else None

    def offer(self, states: Sequence[State], query: PrefixQuery, seconds_per_token: float = 0.0) -> int:
        """Keep the last of ``states`` (the conversation after the answer; it covers the prompt)."""
        if not states:
            return 0
        self.pool.put(self.namespace, states[-1])
        return 1


def _covers(new: State, old: State) -> bool:
    """``new`` serves every request ``old`` could: it starts with ``old``'s tokens and media, can roll
    back to ``old``'s length, and holds at least as many canonical slots, of the same schedule."""
    n = old.tokens_seen
    same = n <= new.tokens_seen and shared_prefix(new, old.tokens, tuple((m.start, m.digest) for m in old.media)) == n
    return (same and not new.rollback_limit(n) and new.canonical_chunk == old.canonical_chunk
            and new.canonical_marks == old.canonical_marks and new.canonical >= min(old.canonical, n)
            and new.fingerprint == old.fingerprint)
