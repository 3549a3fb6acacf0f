"""kvstate's settings as one frozen value: how the engine feeds, how a session plans, how a ``Scheduler`` batches.

One ``Settings`` flows from its maker (``Session``'s keywords, ``Scheduler``'s, ``kvstate serve``'s options)
through the serving runner and the ``Scheduler`` to the engine; nothing below re-spells a setting. It is
checked once, when made.

A session's settings are what the caller gave, else the state's own, else the device's (``resolve``). A state
records the schedule it was fed with (``State.canonical_chunk``, ``canonical_marks`` and the kernels label
``canonical_device``, which names the device type, the attention path and the prefill tile), so a session that
continues a state without naming a schedule takes the state's and its canonical slots stay reusable. A schedule
given explicitly wins, and when it cannot reuse the state's slots a ``ScheduleWarning`` says so. With no state,
``C`` is the device's default (``kvstate.schedule.default_chunk``).

The schedule is off where it cannot keep its promise (``fitted``): families that continue one token per forward,
and attention paths not known to repeat their bits (``kvstate._compat.attention.known_deterministic``:
flash-attn, flex or custom kernels on a GPU); the latter with a ``ScheduleWarning`` naming the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ._compat import attention
from .errors import InputError, ScheduleWarning
from .request import check_marks, check_settings
from .schedule import default_chunk
from .state import State

DEFAULT_RESERVE = 64  # ``sliding_reserve`` when neither the caller nor a state names one


@dataclass(frozen=True)
class Batching:
    """How a ``Scheduler`` batches (``kvstate.batch``; a ``Session`` ignores it).

    Attributes:
        max_batch: streams decoding at once; more requests wait in FIFO order.
        rows: the packed decode's tile: a decode forward has a multiple of ``rows`` rows and its matrix products
            run ``rows`` rows at a time, so an answer is the same in any batch under one ``rows``; 1 keeps
            ``Session``'s one-row decode kernels.
        prefill_tokens: a step feeds about this many prompt tokens (one canonical chunk at least), a longer
            history in pieces over several steps; None: every request that fits, each history whole.
        share_prefixes: a prompt resumes from the longest prefix it shares with the last ``max_batch`` admitted
            ones (``kvstate.batch.prefixes``); a server whose requests belong to different keys turns it off.
        static_shapes: every packed decode step attends over its pool's whole capacity (one set of shapes
            between two growths of a pool, on buffers that do not move: what a captured CUDA graph replays).
    """

    max_batch: int = 16
    rows: int = 16
    prefill_tokens: int | None = None
    share_prefixes: bool = True
    static_shapes: bool = False

    def __post_init__(self) -> None:
        budget = 1 if self.prefill_tokens is None else self.prefill_tokens
        for name, value in (("max_batch", self.max_batch), ("rows", self.rows), ("prefill_tokens", budget)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"Scheduler {name} must be an int >= 1", expected=">= 1", found=repr(value),
                                 fix=f"pass {name}=8, say")


@dataclass(frozen=True)
class Settings:
    """Everything kvstate feeds, plans and batches with (see the module docstring).

    Attributes:
        chunk_size: longest run of tokens fed in one forward when the canonical schedule is off.
        canonical_chunk: ``C``: feeds are cut at multiples of ``C`` and a resume restarts from the last such cut it
            holds, so a warm answer is the cold answer bit for bit in every dtype; 0 keeps the longest common prefix
            instead (exact to float32 rounding).
        canonical_marks: token ids that start a turn (``kvstate.text.turn_marks(tokenizer)``) or line marks: cuts
            also fall where each occurrence begins, so a settled chat's next turn feeds only its own tokens.
        sliding_reserve: slots each sliding-window layer keeps beyond its window and its last append, so the state
            can roll back that far (raised to ``C - 1``: a canonical resume rolls back that far).
        max_checkpoints, checkpoint_every: snapshots of recurrent layers kept for rollback (the oldest evicted first;
            taken after every call and at canonical cuts, and every N tokens inside long feeds).
        prefill_rows: run prefill chunks as tiled forwards of this many rows (``kvstate.engine.batched.prefill``),
            the chunk computation a ``Scheduler`` with the same tile makes, so states move between them bit for
            bit; 0: plain forwards. ``prepack``: the tiles on prepacked weights; ``invariant=False``: plain kernels
            in packed forwards (measures the invariance tax). States record the kernels (``State.canonical_device``).
        batching: the ``Scheduler``'s (``Batching``).
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
    batching: Batching = field(default_factory=Batching)

    def __post_init__(self) -> None:
        check_settings(chunk_size=self.chunk_size, canonical_chunk=self.canonical_chunk,
                       sliding_reserve=self.sliding_reserve, max_checkpoints=self.max_checkpoints,
                       checkpoint_every=self.checkpoint_every, prefill_rows=self.prefill_rows)
        object.__setattr__(self, "canonical_marks", check_marks(self.canonical_marks))
        if not isinstance(self.batching, Batching):
            raise InputError("Settings.batching must be a Batching", expected="kvstate.settings.Batching",
                             found=type(self.batching).__name__, fix="pass batching=Batching(max_batch=8), say")

    @property
    def reserve(self) -> int:
        """Slots a sliding layer keeps beyond its window: a canonical resume restarts at the last cut."""
        return max(self.sliding_reserve, self.canonical_chunk - 1)


def resolve(model: object, state: State | None, *, stepwise: bool, chunk_size: int = 512,
            canonical_chunk: int | None = None, canonical_marks: Sequence[int] | None = None,
            sliding_reserve: int | None = None, max_checkpoints: int = 16, checkpoint_every: int | None = None,
            prefill_rows: int | None = None, prepack: bool = True, invariant: bool = True) -> Settings:
    """The settings of a session on ``model`` continuing ``state`` (None or empty: a new conversation), from
    ``Session``'s keywords: each ``None`` from the state, else the default (module docstring). Checked here."""
    given = state is not None and not state.is_empty
    marks = check_marks(canonical_marks if canonical_marks is not None else state.canonical_marks if given else ())
    device = next(model.parameters()).device.type  # type: ignore[attr-defined]
    if canonical_chunk is None:
        canonical_chunk = state.canonical_chunk if given else default_chunk(marks, device)  # type: ignore[union-attr]
    if prefill_rows is None:
        prefill_rows = tile_of(state.canonical_device) if given else 0  # type: ignore[union-attr]
    if sliding_reserve is None:
        sliding_reserve = _reserve(state) if given else DEFAULT_RESERVE  # type: ignore[arg-type]
    settings = Settings(chunk_size, canonical_chunk, marks, sliding_reserve, max_checkpoints, checkpoint_every,
                        prefill_rows, prepack, invariant)
    return fitted(model, settings, stepwise=stepwise)


def fitted(model: object, settings: Settings, *, stepwise: bool) -> Settings:
    """``settings`` as a session on ``model`` runs them: the canonical schedule off for a family that continues one
    token per forward, and, with a ``ScheduleWarning``, for an attention path not known to repeat its bits."""
    if settings.canonical_chunk and not stepwise and not attention.known_deterministic(model):
        device = next(model.parameters()).device.type  # type: ignore[attr-defined]
        warnings.warn(f"kvstate: the canonical schedule is off: {attention.describe(model)} is not known to give "
                      f"the same bits run after run on {device}, so no resume can be bitwise a cold run; resumes "
                      "reuse the longest common prefix (exact to rounding). Load the model with "
                      "attn_implementation='sdpa' or 'eager' for bitwise resumes", ScheduleWarning, stacklevel=4)
        return replace(settings, canonical_chunk=0)
    return replace(settings, canonical_chunk=0) if stepwise and settings.canonical_chunk else settings


def check_continues(state: State, settings: Settings, kernels: str) -> None:
    """Warn when a session given ``state`` was told a schedule under which the state's slots are not reusable
    (they are fed again on the next call): its canonical slots come from other chunks or kernels, or it was fed
    off the schedule. A session with the schedule off reuses any common prefix: nothing to say."""
    if state.is_empty or state.is_compressed or not settings.canonical_chunk or \
            state.canonical_for(settings.canonical_chunk, kernels, settings.canonical_marks):
        return
    cast = state.metadata.get("kvstate.cast")
    if cast is not None and not state.canonical:  # the cause is the cast, whatever the schedule
        warnings.warn(f"kvstate: the state was cast ({cast}), so its {state.tokens_seen} slots are not what this "
                      "model computes and the canonical schedule feeds them again; pass canonical_chunk=0 "
                      "(kvstate generate: --canonical-chunk 0) to reuse them, exact only to the cast's rounding",
                      ScheduleWarning, stacklevel=4)
        return
    fed = (f"canonical_chunk={state.canonical_chunk} on {state.canonical_device or 'unknown kernels'}"
           if state.canonical else "canonical_chunk=0 (off the schedule)")
    warnings.warn(f"kvstate: this session's schedule (canonical_chunk={settings.canonical_chunk} on {kernels}) is "
                  f"not the one the state was fed with ({fed}): its {state.tokens_seen} slots will be fed again; "
                  "leave canonical_chunk, canonical_marks and prefill_rows unset to continue under the state's own "
                  "schedule", ScheduleWarning, stacklevel=4)


def tile_of(label: str) -> int:
    """The prefill tile a kernels label names (``kvstate.engine.batched.prefill.kernels_label``); 0 for plain
    forwards."""
    _, _, tail = label.partition("+tile")
    digits = tail.split("/")[0]
    return int(digits) if digits.isdigit() else 0


def _reserve(state: State) -> int:
    """The sliding reserve the state's layers were made with (the default where none records one)."""
    return max((int(layer.meta().get("reserve") or 0) for layer in state.layers), default=DEFAULT_RESERVE)
