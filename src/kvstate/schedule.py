"""The canonical schedule: every token's K/V comes from a forward of the same shape, however the
history was reached (issue 23).

Low precision rounds a computation differently when its shape changes: a prefill split
at another point, or a decode step instead of a prefill chunk, gives other bits for
the same token. So a warm answer (a resumed state, a fork, a file, a store or pool hit)
equals the cold one (a new ``Session`` on the whole history) bit for bit only if both
computed every slot through the same forwards. The canonical schedule fixes those
forwards as a function of the history alone:

* a history of ``L`` tokens is fed in chunks that end at the **cuts**: the multiples
  of ``C`` below ``L``, each moved past any media item it would split (to the item's
  end), then ``L`` itself;
* a state records how many leading slots it fed that way (``State.canonical``) and
  with which ``C``. Its slots up to the last cut at or before that count are the
  cold run's for any longer history with the same prefix; the slots after that cut
  belong to a partial last chunk (or were decoded one per forward) and are fed again;
* a state whose every slot is canonical holds the cold run's last logits for exactly
  its own history.

Everything here is pure: positions are slot indices, ``spans`` are ``[start, end)`` media
items (``kvstate.resume`` and ``kvstate.engine`` apply it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Spans = Sequence[tuple[int, int]]


@dataclass(frozen=True)
class Canonical:
    """Chunks of ``chunk`` tokens aligned to absolute slot indices (the default schedule).

    ``chunk`` is ``C``; 0 turns the schedule off: a resume keeps the longest common
    prefix and feeds the rest from there (exact to a tolerance in float32, not bitwise).
    ``device`` is the device type the schedule runs on: slots computed on another are not its.
    """

    chunk: int
    device: str = "cpu"

    @property
    def enabled(self) -> bool:
        return self.chunk > 0

    def cuts(self, start: int, end: int, spans: Spans = ()) -> list[int]:
        """Chunk ends of a feed of slots ``[start, end)`` that starts at a cut: the cuts in
        ``(start, end)``, then ``end``."""
        if not self.enabled:
            return [end]
        points = sorted({_moved(k * self.chunk, spans) for k in range(start // self.chunk + 1,
                                                                         (end - 1) // self.chunk + 1)})
        return [p for p in points if start < p < end] + [end]

    def last_cut(self, n: int, spans: Spans = ()) -> int:
        """The largest cut ``<= n`` (0 if none): where a resume that may keep ``n`` slots restarts."""
        if not self.enabled:
            return n
        for k in range(n // self.chunk, 0, -1):
            point = _moved(k * self.chunk, spans)
            if point <= n:
                return point
        return 0


def _moved(point: int, spans: Spans) -> int:
    """``point``, moved to the end of the media item it falls strictly inside (never splitting one)."""
    for start, end in sorted(spans):
        if start < point < end:
            return end
    return point
