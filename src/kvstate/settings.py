"""A ``Session``'s settings, as one frozen value: what the caller gave, else the state's own, else the device's.

A state records the schedule it was fed with (``State.canonical_chunk``, ``canonical_marks`` and the kernels
label ``canonical_device``, which names the device type, the attention path and the prefill tile). A session
that continues a state without naming a schedule takes the state's, so its canonical slots stay reusable:
a state fed with ``canonical_chunk=0`` is continued with 0 (reusing every slot), one fed in chunks of 64
with 64, a loaded file with the schedule it was saved under. A schedule given explicitly wins, and when it
cannot reuse the state's slots a ``ScheduleWarning`` says so. With no state, ``C`` is the device's default
(``kvstate.schedule.default_chunk``).

The schedule is off where it cannot keep its promise: families that continue one token per forward, and
attention paths not known to repeat their bits (``kvstate._compat.attention.known_deterministic``: flash-attn,
flex or custom kernels on a GPU); the latter with a ``ScheduleWarning`` naming the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from ._compat import attention
from .engine.batched.prefill import tile_of
from .engine.values import FeedSettings
from .errors import ScheduleWarning
from .request import check_marks, check_settings
from .schedule import default_chunk
from .state import State

DEFAULT_RESERVE = 64  # ``sliding_reserve`` when neither the caller nor a state names one


@dataclass(frozen=True)
class SessionSettings:
    """Everything a ``Session`` feeds and plans with.

    Attributes:
        chunk_size: longest run of tokens fed in one forward when the canonical schedule is off.
        canonical_chunk: ``C``: feeds are cut at multiples of ``C`` and a resume restarts from the last such cut it
            holds, so a warm answer is the cold answer bit for bit in every dtype; 0 keeps the longest common prefix
            instead (exact to float32 rounding). Default: the device's (``kvstate.schedule.default_chunk``).
        canonical_marks: token ids that start a turn (``kvstate.text.turn_marks(tokenizer)``): cuts also fall where
            each occurrence begins, so a settled chat's next turn (``Session.settle(through=...)``) feeds only its own.
        sliding_reserve: slots each sliding-window layer keeps beyond its window and its last append, so the state
            can roll back that far (raised to ``C - 1``: a canonical resume rolls back that far).
        max_checkpoints, checkpoint_every: snapshots of recurrent layers kept for rollback (the oldest evicted first;
            taken after every call and at canonical cuts, and every N tokens inside long feeds).
        prefill_rows: run prefill chunks as tiled forwards of this many rows (``kvstate.engine.batched.prefill``), the
            chunk computation a ``Scheduler`` with the same tile makes, so states move between them bit for bit; 0:
            plain forwards. ``prepack``: the tiles on prepacked weights; ``invariant=False``: plain kernels in packed
            forwards (measures the invariance tax). States record the kernels (``State.canonical_device``).
    """

    chunk_size: int = 512
    canonical_chunk: int = 64
    canonical_marks: tuple[int, ...] = ()
    sliding_reserve: int = DEFAULT_RESERVE
    max_checkpoints: int = 16
    checkpoint_every: int | None = None
    prefill_rows: int = 0
    prepack: bool = True
    invariant: bool = True

    @property
    def reserve(self) -> int:
        """Slots a sliding layer keeps beyond its window: a canonical resume restarts at the last cut."""
        return max(self.sliding_reserve, self.canonical_chunk - 1)

    def feed(self) -> FeedSettings:
        return FeedSettings(self.chunk_size, self.checkpoint_every, self.max_checkpoints, self.canonical_chunk,
                            self.canonical_marks, self.prefill_rows, self.prepack, self.invariant)


def resolve(model: object, state: State | None, *, stepwise: bool, chunk_size: int = 512,
            canonical_chunk: int | None = None, canonical_marks: Sequence[int] | None = None,
            sliding_reserve: int | None = None, max_checkpoints: int = 16, checkpoint_every: int | None = None,
            prefill_rows: int | None = None, prepack: bool = True, invariant: bool = True) -> SessionSettings:
    """The settings of a session on ``model`` continuing ``state`` (None or empty: a new conversation): each
    ``None`` argument from the state, else the default (module docstring). Checked here, before any work."""
    given = state is not None and not state.is_empty
    marks = check_marks(canonical_marks if canonical_marks is not None else state.canonical_marks if given else ())
    device = next(model.parameters()).device.type  # type: ignore[attr-defined]
    if canonical_chunk is None:
        canonical_chunk = state.canonical_chunk if given else default_chunk(marks, device)  # type: ignore[union-attr]
    if prefill_rows is None:
        prefill_rows = tile_of(state.canonical_device) if given else 0  # type: ignore[union-attr]
    if sliding_reserve is None:
        sliding_reserve = _reserve(state) if given else DEFAULT_RESERVE  # type: ignore[arg-type]
    check_settings(chunk_size=chunk_size, canonical_chunk=canonical_chunk, sliding_reserve=sliding_reserve,
                   max_checkpoints=max_checkpoints, checkpoint_every=checkpoint_every, prefill_rows=prefill_rows)
    if canonical_chunk and not stepwise and not attention.known_deterministic(model):
        warnings.warn(f"kvstate: the canonical schedule is off: {attention.describe(model)} is not known to give "
                      f"the same bits run after run on {device}, so no resume can be bitwise a cold run; resumes "
                      "reuse the longest common prefix (exact to rounding). Load the model with "
                      "attn_implementation='sdpa' or 'eager' for bitwise resumes", ScheduleWarning, stacklevel=3)
        canonical_chunk = 0
    return SessionSettings(chunk_size, 0 if stepwise else canonical_chunk, marks, sliding_reserve,
                           max_checkpoints, checkpoint_every, prefill_rows, prepack, invariant)


def check_continues(state: State, settings: SessionSettings, kernels: str) -> None:
    """Warn when a session given ``state`` was told a schedule under which the state's slots are not reusable
    (they are fed again on the next call): its canonical slots come from other chunks or kernels, or it was fed
    off the schedule. A session with the schedule off reuses any common prefix: nothing to say."""
    if state.is_empty or state.is_compressed or not settings.canonical_chunk or \
            state.canonical_for(settings.canonical_chunk, kernels, settings.canonical_marks):
        return
    fed = (f"canonical_chunk={state.canonical_chunk} on {state.canonical_device or 'unknown kernels'}"
           if state.canonical else "canonical_chunk=0 (off the schedule)")
    warnings.warn(f"kvstate: this session's schedule (canonical_chunk={settings.canonical_chunk} on {kernels}) is "
                  f"not the one the state was fed with ({fed}): its {state.tokens_seen} slots will be fed again; "
                  "leave canonical_chunk, canonical_marks and prefill_rows unset to continue under the state's own "
                  "schedule", ScheduleWarning, stacklevel=4)


def _reserve(state: State) -> int:
    """The sliding reserve the state's layers were made with (the default where none records one)."""
    return max((int(layer.meta().get("reserve") or 0) for layer in state.layers), default=DEFAULT_RESERVE)
