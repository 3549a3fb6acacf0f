"""When the server settles a reply: recomputing its answer in canonical chunks, so the next turn reuses it.

A reply's state ends with decoded tokens, which the canonical schedule does not reuse; a settle
(``Session.settle``) feeds them again in canonical chunks, up to where the next turn will start (``through``:
the ids the template renders the answer as, for a chat's turn marks or a raw prompt's line marks). It is
one forward, run on the model thread when nothing else waits, or just before the conversation's next
request, whichever comes first:

* ``settle_idle``: while the model is idle, settle the waiting replies, newest first; each first waits
  ``SETTLE_GRACE`` for a request, and yields to one that arrives, so another chat never queues behind it;
* ``settle_for``: a request that continues a waiting reply (an agent's next turn, sent as soon as the reply
  arrived) settles it first and resumes from it, so its reuse does not depend on the client's timing.

At most 16 replies wait (the oldest is dropped), and only while the pool holds their states
(``forget_unpooled``): a waiting settle never keeps K/V past the pool's budget. A settle that fails costs
the next turn a re-feed, never an answer.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..protocols import PrefixCache, PrefixQuery
from ..schedule import Canonical
from ..settings import Settings
from .pool import StatePool

# How long an idle model waits before settling a reply: a client that sends its next request as soon as
# a reply ends gets it to the runner within a few milliseconds (rendering and tokenizing included)
SETTLE_GRACE = 0.05


@dataclass(frozen=True, eq=False)  # compared by identity: the deque removes this entry, not an equal one
class Unsettled:
    """A reply waiting for its settle: its conversation's ``namespace``, the ``state`` after it, and the ids the
    next turn begins with (``through``, None: settle the decoded tokens up to the last cut)."""

    namespace: str
    state: Any
    through: list[int] | None = None
    marks: tuple[int, ...] = ()  # the schedule the reply was fed with, and is settled with

    def continued_by(self, ids: list[int]) -> bool:
        """Whether a prompt of ``ids`` continues this reply: it begins with ``through`` (or the state's tokens)
        and goes on past them."""
        known = self._known()
        return len(ids) > len(known) and ids[:len(known)] == known

    def settles_for(self, ids: list[int], chunk: int) -> bool:
        """Whether, for a prompt of ``ids`` that continues this reply, settling first moves where its resume
        restarts: to the settle's end (a cut of the prompt's history), past the last cut before the reply's
        decoded tokens. Not when the prompt goes on inside the reply's last segment (a raw prompt that
        continues the answer's line): the settled slots would be fed again."""
        schedule, known = Canonical(chunk, marks=self.marks), len(self._known())
        return schedule.last_cut(known, ids=ids) > schedule.last_cut(min(self.state.canonical, known), ids=ids)

    def _known(self) -> list[int]:
        return list(self.through) if self.through is not None else self.state.tokens[0].tolist()


class Settler:
    """The replies waiting for their settle, and when each runs (see the module docstring). Its methods run on
    the model thread; ``idle(seconds)`` says whether no request arrives within that long."""

    def __init__(self, model: Any, pool: StatePool, settings: Settings, fingerprint: Any,
                 idle: Callable[[float], bool], store_for: Callable[[str], PrefixCache | None]) -> None:
        self.model, self.pool, self.settings, self.fingerprint, self.idle = model, pool, settings, fingerprint, idle
        self.store_for = store_for
        self.waiting: deque[Unsettled] = deque(maxlen=16)

    def defer(self, namespace: str, state: Any, through: list[int] | None, marks: tuple[int, ...]) -> None:
        """Queue the settle of a reply whose state is ``state`` (nothing to settle without the schedule, or with
        a pool of 0 bytes: no reuse)."""
        if self.settings.canonical_chunk and self.pool.max_bytes:
            self.waiting.append(Unsettled(namespace, state, through, marks))

    def settle_idle(self) -> None:
        """Settle the waiting replies, newest first, while no request arrives within ``SETTLE_GRACE``. Settled
        here, a state goes to the store too: a restarted server, or another one on the same store, resumes
        from it."""
        while True:
            self.forget_unpooled()
            if not self.waiting or not self.idle(SETTLE_GRACE):
                return
            self._settle(self.waiting.pop(), store=True)

    def settle_all(self) -> None:
        """At the end of a graceful stop: settle every waiting reply into the pool and the store, so a restarted
        server reuses as much as one that never stopped (the pool goes with the process)."""
        self.forget_unpooled()
        while self.waiting:
            self._settle(self.waiting.pop(), store=True)

    def settle_for(self, namespace: str, ids: list[int]) -> None:
        """Before a request of ``ids`` runs: settle the waiting reply its prompt continues (same namespace), and
        pool the settled state, which the request then resumes from."""
        for entry in reversed(self.waiting):  # the newest first: it is the longest of its conversation
            if entry.namespace == namespace and entry.continued_by(ids):
                self.waiting.remove(entry)  # its conversation went on: the idle model need not settle it
                if entry.settles_for(ids, self.settings.canonical_chunk):
                    self._settle(entry)
                return

    def forget_unpooled(self) -> None:
        """Drop the waiting settles of states the pool no longer holds: their chat went on (a newer state covers
        them) or the pool evicted them, and holding them here would keep their K/V past the pool's budget."""
        held = [entry for entry in self.waiting if self.pool.holds(entry.namespace, entry.state)]
        self.waiting.clear()
        self.waiting.extend(held)

    def _settle(self, entry: Unsettled, store: bool = False) -> None:
        """Recompute the reply's decoded tokens in canonical chunks and pool the settled state (with ``store``,
        offer it to the namespace's store too: a failing store warns and counts, as every store write does)."""
        from ..session import Session

        try:
            settings = replace(self.settings, canonical_marks=entry.marks)
            session = Session(self.model, state=entry.state, fingerprint=self.fingerprint, settings=settings)
            if session.settle(entry.through):
                self.pool.put(entry.namespace, session.state)
                sink = self.store_for(entry.namespace) if store else None
                if sink is not None:
                    state = session.state
                    media = tuple((m.start, m.digest) for m in state.media)
                    sink.offer([state], PrefixQuery(self.fingerprint, state.tokens.cpu(), media))
        except Exception:  # an optimisation: the unsettled state is in the pool already; say why it failed
            logging.getLogger("kvstate.serve").warning("settling a reply failed", exc_info=True)
