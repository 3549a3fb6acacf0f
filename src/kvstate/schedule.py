"""The canonical schedule: every token's K/V comes from a forward of the same shape, however the
history was reached.

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

**Turn marks** (``marks``, a token sequence such as a chat template's ``"<start_of_turn>user\n"``)
make the cuts follow the conversation: every occurrence of the marks (at least ``MIN_SEGMENT``
tokens after the previous one) starts a segment, and the chunks of ``C`` are aligned to the
segment's start. A chat's next turn then starts on a cut, so once the answer has been settled
(``Session.settle(through=...)``) the turn feeds only its own tokens: one forward, as with no
schedule. The cuts are still a function of the token ids alone (the cold run finds the same
marks), and prefix-stable, with one exception handled by ``keeps``: a history that ends inside
an incomplete mark.

**Line marks** do the same for text without a chat template: ``(LINES, *ids)`` (``lines(ids)``,
``kvstate.text.line_marks(tokenizer)``) starts a segment at every token among ``ids``, the tokens whose text begins
with a line break, at least ``LINE_SEGMENT`` tokens after the previous start. A cut is decided by the token at it
(no look-ahead): a history's cuts before any point depend only on its ids up to that point. The cut *at* a point
depends on the token there, so a history that leaves a state exactly where a line starts reuses the state's slots
before it only if the state's feed cut there too (``kvstate.resume.shared_cut``). Every line is a forward, so a
cold multi-line prompt pays a forward's fixed cost per line; states made so keep their meaning, and ``kvstate
serve`` now cuts raw prompts with prompt marks.

**Prompt marks** cut a raw prompt where a conversation goes on from it, and seldom elsewhere:
``(PROMPT, gap, n, *label, *breaks)`` (``prompt(breaks, label, gap)``, ``kvstate.text.PromptMarks``) cuts,
scanning the ids left to right with the previous cut ``last``,

* right after every occurrence of a line start (a token among ``breaks``) followed by the ``n`` tokens of
  ``label``: the label of the prompt's own last line (``"A:"``, ``"Answer:"``). A client that keeps one prompt and
  appends the answer and its next question, ending with the same label, finds every earlier prompt's end on a
  cut, so a turn feeds the previous answer and its own tokens in one forward (the answer was decoded one token
  per forward, so it is fed again, as with every schedule);
* at a line start at least ``gap`` tokens after ``last``: a new prompt that shares a document with an earlier one
  restarts near where it departs, while a cold document is cut about every ``gap`` tokens, not every line;
* at ``last + C`` when nothing cut before.

Every decision at ``p`` reads the ids before ``p`` and the token at ``p``, so the cuts are prefix-stable as line
marks are (the cut at a history's very end is settled by ``shared_cut`` the same way), and a settle can only end
on a cut its own ids decide (``settled_end``). ``PROMPT`` is negative and differs from ``LINES``, so prompt, line
and turn marks are never mistaken for one another, and a reader that predates prompt marks refuses such a file.

Everything here is pure: positions are slot indices, ``spans`` are ``[start, end)`` media
items (``kvstate.resume`` and ``kvstate.engine`` apply it).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

Spans = Sequence[tuple[int, int]]
Ids = torch.Tensor | Sequence[int] | None
MIN_SEGMENT = 8  # a mark closer than this to the previous segment start (a BOS before it) starts none
# The default C per device type, chosen from measured forward costs (docs/exactness.md, "Settings and the opt-out";
# docs/gpu.md). Cutting at positions, a resume re-feeds the tail since the last multiple of C (so C is small) and a
# cold prefill pays for small chunks (so not too small); with turn marks a turn starts on a cut, so C only needs to
# hold a turn: up to C tokens, one forward.
# * cpu (bench/bench_canonical.py): a forward costs about its tokens, so a small C is cheap: 64, and 256 with
#   turn marks.
# * cuda: an eager forward costs a fixed price of kernel launches whatever its length, so the forward count
#   decides: 512 (docs/benchmarks.md; ``scripts/device_run.py`` measures it again).
# Other devices take the CPU's values until they are measured.
POSITION_CHUNK = 64
MARKED_CHUNK = 256
DEVICE_CHUNKS = {"cpu": (POSITION_CHUNK, MARKED_CHUNK), "cuda": (512, 512)}
LINES = -1  # first entry of line marks (``lines``): the other entries are the tokens that start a line
PROMPT = -2  # first entry of prompt marks (``prompt``): gap, label length, label, line-start tokens
# Line segments are one line each, however short: a short answer's line must end on a cut, so its continuation
# feeds only its own tokens. Only one-token segments (a line break right after another) are merged away
LINE_SEGMENT = 2
MAX_TURN_MARKS, MAX_LINE_TOKENS = 64, 4096
MAX_LABEL = 16  # tokens of a prompt marks' label (a line's label, trailing whitespace included)
# Prompt marks cut at a line start only a gap of C / GAP_DIVISOR tokens or more after the previous cut: a cold
# document costs about a forward per gap (a forward's fixed cost spread over that many tokens), not one per line,
# and a new prompt that departs from a shared document restarts within about a gap and a line before it
GAP_DIVISOR = 4


def default_chunk(marks: Sequence[int] = (), device: str = "cpu") -> int:
    """The default ``C`` on a ``device`` type (``DEVICE_CHUNKS``): with turn marks or without."""
    plain, marked = DEVICE_CHUNKS.get(device, DEVICE_CHUNKS["cpu"])
    return marked if len(marks) else plain


def default_gap(chunk: int) -> int:
    """The ``gap`` of prompt marks under ``C = chunk``: ``C / GAP_DIVISOR``, at least 1."""
    return max(1, chunk // GAP_DIVISOR)


def prompt(breaks: Iterable[int], label: Sequence[int] = (), gap: int = 64) -> tuple[int, ...]:
    """Prompt marks (see the module docstring): line-start tokens ``breaks``, the prompt's last-line ``label``
    (``()``: none) and the ``gap`` in tokens after which a line start is a cut."""
    return (PROMPT, gap, len(label), *label, *sorted(set(breaks)))


def lines(ids: Iterable[int]) -> tuple[int, ...]:
    """Line marks: a segment starts at each token among ``ids`` (see the module docstring)."""
    return (LINES, *sorted(set(ids)))


def valid_marks(values: Sequence[object]) -> bool:
    """Whether ``values`` are marks: none, 1 to ``MAX_TURN_MARKS`` token ids (a turn-mark sequence), ``LINES``
    then 1 to ``MAX_LINE_TOKENS`` increasing token ids (line marks), or ``PROMPT``, a gap of 1 to ``2**20``, a
    label length ``n`` of 0 to ``MAX_LABEL``, ``n`` token ids, then 1 to ``MAX_LINE_TOKENS`` increasing token ids
    (prompt marks). Token ids are ints in ``[0, 2**31)``."""
    if not values:
        return True
    if not all(type(t) is int for t in values):
        return False
    ids: list[int] = list(values)  # type: ignore[arg-type]
    if ids[0] == PROMPT:
        if len(ids) < 4 or not 0 < ids[1] <= 1 << 20 or not 0 <= ids[2] <= MAX_LABEL:
            return False
        n = ids[2]
        label = ids[3:3 + n]
        return len(label) == n and all(0 <= t < 1 << 31 for t in label) and _increasing(ids[3 + n:])
    if ids[0] == LINES:
        return _increasing(ids[1:])
    return len(ids) <= MAX_TURN_MARKS and all(0 <= t < 1 << 31 for t in ids)


def _increasing(ids: list[int]) -> bool:
    """1 to ``MAX_LINE_TOKENS`` strictly increasing token ids."""
    return 0 < len(ids) <= MAX_LINE_TOKENS and all(0 <= a < b < 1 << 31 for a, b in itertools.pairwise(ids)) \
        and 0 <= ids[0] < 1 << 31


@dataclass(frozen=True)
class Canonical:
    """Chunks of ``chunk`` tokens aligned to absolute slot indices (the default schedule).

    ``chunk`` is ``C``; 0 turns the schedule off: a resume keeps the longest common
    prefix and feeds the rest from there (exact to a tolerance in float32, not bitwise).
    ``device`` is the device type the schedule runs on: slots computed on another are not its.
    ``marks``: token ids whose occurrences start segments (see the module docstring); every method
    then needs the history's ids ``ids`` (``[L]``, at least up to the slots it asks about).
    """

    chunk: int
    device: str = "cpu"
    marks: tuple[int, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.chunk > 0

    def cuts(self, start: int, end: int, spans: Spans = (), ids: Ids = None) -> list[int]:
        """Chunk ends of a feed of slots ``[start, end)`` that starts at a cut: the cuts in
        ``(start, end)``, then ``end``."""
        if not self.enabled:
            return [end]
        if self.marks:
            return [p for p in self._points(end, spans, ids) if start < p < end] + [end]
        points = sorted({_moved(k * self.chunk, spans) for k in range(start // self.chunk + 1,
                                                                         (end - 1) // self.chunk + 1)})
        return [p for p in points if start < p < end] + [end]

    def last_cut(self, n: int, spans: Spans = (), ids: Ids = None) -> int:
        """The largest cut ``<= n`` (0 if none): where a resume that may keep ``n`` slots restarts."""
        if not self.enabled:
            return n
        if self.marks:
            return max((p for p in self._points(n, spans, ids) if p <= n), default=0)
        for k in range(n // self.chunk, 0, -1):
            point = _moved(k * self.chunk, spans)
            if point <= n:
                return point
        return 0


    def keeps(self, start: int, end: int, ids: Ids = None) -> int:
        """How many leading slots a feed's last chunk ``[start, end)`` leaves canonical: ``end``, or
        ``start`` when the history ends inside an incomplete mark that begins after ``start`` (a longer
        history completes it and cuts there, inside this chunk). Line marks are one token: never incomplete."""
        if not self.marks or end <= start or self.marks[0] == LINES:
            return end
        tail = _as_list(ids, end, max(start + 1, end - len(self.marks) + 1))
        partial = any(tail[i:] == list(self.marks[:len(tail) - i]) for i in range(len(tail)))
        return start if partial else end

    def settled_end(self, n: int, spans: Spans = (), ids: Ids = None) -> int:
        """Where a settle through ``ids[:n]``, the ids a next history begins with, ends: ``n`` under turn and line
        marks (the caller's next history starts a mark or a line there), else the last cut that ``ids[:n]``
        decide (prompt marks: the token that follows them may start a line or not)."""
        if not self.marks or self.marks[0] != PROMPT:
            return n
        return self.last_cut(n, spans, _as_list(ids, n))

    def _points(self, limit: int, spans: Spans, ids: Ids) -> list[int]:
        """Every cut in ``(0, limit]`` under turn, line or prompt marks, ascending: segment starts, and the
        multiples of ``C`` after each start, moved past media."""
        if self.marks[0] == PROMPT:
            return sorted({p for p in (_moved(c, spans) for c in self._prompt_cuts(limit, ids)) if p <= limit})
        starts = self._line_starts(limit, ids) if self.marks[0] == LINES else self._turn_starts(limit, ids)
        bounds = [*starts[1:], limit + 1]
        points = {_moved(s + k * self.chunk, spans) for s, nxt in zip(starts, bounds, strict=True)
                  for k in range(1, (nxt - s - 1) // self.chunk + 1)}
        points |= {_moved(s, spans) for s in starts[1:]}
        return sorted(p for p in points if 0 < p <= limit)

    def _turn_starts(self, limit: int, ids: Ids) -> list[int]:
        """0, then every occurrence of the turn marks at least ``MIN_SEGMENT`` after the previous start."""
        tokens, m = _as_list(ids, limit + len(self.marks)), len(self.marks)
        starts, marks = [0], list(self.marks)
        for p in (i for i, t in enumerate(tokens[:len(tokens) - m + 1]) if t == marks[0]):
            if p - starts[-1] >= MIN_SEGMENT and tokens[p:p + m] == marks:
                starts.append(p)
        return starts

    def _line_starts(self, limit: int, ids: Ids) -> list[int]:
        """0, then every token in ``(0, limit]`` that starts a line, at least ``LINE_SEGMENT`` after the
        previous start."""
        breaks = self._breaks
        starts = [0]
        for p, t in enumerate(_as_list(ids, limit + 1)):
            if t in breaks and p - starts[-1] >= LINE_SEGMENT:
                starts.append(p)
        return starts

    def _prompt_cuts(self, limit: int, ids: Ids) -> list[int]:
        """The cuts in ``(0, limit]`` under prompt marks, before media (the module docstring's three rules). The
        scan covers all of ``ids`` and is kept for the next call: a feed asks about every chunk's end in turn."""
        tokens = tuple(_as_list(ids, 1 << 62))
        cuts = _prompt_scan(self.chunk, *self._prompt, tokens, max(limit, len(tokens)))
        return [c for c in cuts if c <= limit]

    @functools.cached_property
    def _breaks(self) -> frozenset[int]:
        return frozenset(self.marks[1:])

    @functools.cached_property
    def _prompt(self) -> tuple[int, tuple[int, ...], frozenset[int]]:
        """Prompt marks as ``(gap, label, breaks)``."""
        n = self.marks[2]
        return self.marks[1], tuple(self.marks[3:3 + n]), frozenset(self.marks[3 + n:])


@functools.lru_cache(maxsize=16)
def _prompt_scan(chunk: int, gap: int, label: tuple[int, ...], breaks: frozenset[int], tokens: tuple[int, ...],
                 limit: int) -> tuple[int, ...]:
    """The cuts in ``(0, limit]`` of ``tokens`` under prompt marks: left to right, ``p`` is a cut when ``label``
    follows a line start right before it, when ``p`` starts a line ``gap`` or more after the previous cut, or
    when it is ``chunk`` after it."""
    n, k = len(tokens), len(label)
    cuts, last = [], 0
    for p in range(1, limit + 1):
        labelled = k and k < p <= n and tokens[p - 1] == label[-1] and tokens[p - k - 1] in breaks \
            and tokens[p - k:p] == label
        if labelled or p - last >= chunk or (p < n and p - last >= gap and tokens[p] in breaks):
            cuts.append(p)
            last = p
    return tuple(cuts)


def _as_list(ids: Ids, n: int, start: int = 0) -> list[int]:
    """``ids[start:n]`` as ints (only that slice is converted)."""
    if ids is None:
        raise ValueError("a schedule with turn marks needs the history's token ids")
    if isinstance(ids, torch.Tensor):
        return ids.reshape(-1)[start:n].tolist()
    return list(ids[start:n])


def _moved(point: int, spans: Spans) -> int:
    """``point``, moved to the end of the media item it falls strictly inside (never splitting one)."""
    for start, end in sorted(spans):
        if start < point < end:
            return end
    return point
