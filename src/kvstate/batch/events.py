"""What ``kvstate.batch.Scheduler`` takes and gives: a ``BatchRequest``, the events of its run (``Token``,
``Done`` with a ``Completion``, ``Failed``), checked at entry (continuous batching)."""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ..errors import InputError
from ..protocols import PrefixCache
from ..state import State
from .sampling import Choice, Processor, Sampling

MAX_TOP_LOGPROBS = 20  # OpenAI's bound


@dataclass(frozen=True)
class BatchRequest:
    """One conversation to continue: its full history ``ids`` (``[L]`` or ``[1, L]``), media ``inputs``
    for it (``pixel_values``...), an optional ``state`` to resume from, prefix ``sources`` of its own
    (after the scheduler's: a server's pool namespace and store), its canonical ``marks`` when they are not the
    scheduler's (a server's raw prompts: prompt marks; its chats: turn marks), and how to answer: ``processors``
    are logits processors (``generate``'s signature, fresh per request: some keep state) applied in
    order to the raw float32 logits before sampling; logprobs stay the raw logits'."""

    ids: torch.Tensor | Sequence[int]
    max_new_tokens: int = 16
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: tuple[int, ...] | None = None  # None: the model's end-of-sequence ids
    top_logprobs: int = 0
    processors: tuple[Processor, ...] = ()  # logits processors, run on this request's row before choosing
    inputs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    state: State | None = None
    sources: tuple[PrefixCache, ...] = ()
    marks: tuple[int, ...] | None = None  # the canonical schedule's marks for this history (None: the scheduler's)

    def __post_init__(self) -> None:
        if self.marks is not None:
            from ..request import check_marks

            object.__setattr__(self, "marks", check_marks(self.marks))
        if not all(callable(p) for p in self.processors):
            raise InputError("BatchRequest.processors must be logits processors", expected="callables (ids, scores)",
                             found=[type(p).__name__ for p in self.processors], fix="pass LogitsProcessor objects")
        for name, value, low, high in (("max_new_tokens", self.max_new_tokens, 1, None),
                                       ("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS)):
            if not int_in(value, low, high):
                raise InputError(f"BatchRequest.{name} out of range", expected=f"an int in [{low}, {high or 'inf'}]",
                                 found=repr(value), fix=f"pass {name} as an int in range")


@dataclass(frozen=True)
class Completion:
    """A finished request: new ``tokens``, each one's ``logprobs`` and ``top_logprobs``, ``finish_reason``
    (``stop``, ``length`` or ``cancelled``), the ``state`` after the answer (None when cancelled), the
    state right after the history, and the slots reused from ``BatchRequest.state`` or a source."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...]
    finish_reason: str
    state: State | None
    prefilled: State | None
    reused: int


@dataclass(frozen=True)
class Token:
    """Event: request ``handle`` chose a token."""

    handle: int
    choice: Choice


@dataclass(frozen=True)
class Done:
    """Event: request ``handle`` finished."""

    handle: int
    completion: Completion


@dataclass(frozen=True)
class Failed:
    """Event: request ``handle`` could not start (its history, media or state was refused); nothing ran
    for it, and the other requests go on."""

    handle: int
    error: Exception


Event = Token | Done | Failed


def int_in(value: object, low: int, high: int | None) -> bool:
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return not isinstance(value, bool) and n >= low and (high is None or n <= high)
