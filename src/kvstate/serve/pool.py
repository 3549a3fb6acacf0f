"""An in-memory pool of recent conversation states: least recently used first out, under a byte budget.

Each API key's states live in its own namespace; a lookup never sees another
namespace. States are immutable, so one pooled state can start several requests
(a regenerated answer, two branches of one chat) without copies. A state whose
tokens are a prefix of a newer one is dropped when the newer one can be cut back to
it (every layer rolls back there), since the newer one then serves the same requests.
"""

from __future__ import annotations

from collections import OrderedDict
from threading import Lock

import torch

from ..state import State


class StatePool:
    """Recent states by ``(namespace, id)``; ``max_bytes`` bounds the sum of ``state.nbytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._states: OrderedDict[tuple[str, int], State] = OrderedDict()
        self._next = 0
        self._lock = Lock()  # the worker writes, /metrics reads

    def longest(self, namespace: str, ids: torch.Tensor) -> tuple[State | None, int]:
        """The pooled state sharing the longest token prefix with ``ids`` ``[1, L]``, and that length."""
        best: tuple[State | None, int] = (None, 0)
        with self._lock:
            candidates = [(key, s) for key, s in self._states.items() if key[0] == namespace]
        for key, state in candidates:
            n = _common(state.tokens[0], ids[0])
            if n > best[1]:
                best = (state, n)
                best_key = key
        if best[0] is not None:
            with self._lock:
                if best_key in self._states:
                    self._states.move_to_end(best_key)
        return best

    def put(self, namespace: str, state: State) -> None:
        """Add ``state`` (one row, no padding), drop the states it covers, then evict down to the budget."""
        if state.batch_size != 1 or state.is_empty:
            return
        with self._lock:
            for key, old in list(self._states.items()):
                if key[0] == namespace and _covers(state, old):
                    del self._states[key]
            self._states[(namespace, self._next)] = state
            self._next += 1
            while self._states and self.nbytes > self.max_bytes:
                self._states.popitem(last=False)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._states.values())

    def __len__(self) -> int:
        return len(self._states)


def _common(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.shape[0], b.shape[0])
    differ = (a[:n].cpu() != b[:n].cpu()).nonzero()
    return int(differ[0]) if differ.numel() else n


def _covers(new: State, old: State) -> bool:
    n = old.tokens_seen
    return (n <= new.tokens_seen and _common(new.tokens[0], old.tokens[0]) == n
            and not new.rollback_limit(n) and bool(new.mask[:, :n].all()))
