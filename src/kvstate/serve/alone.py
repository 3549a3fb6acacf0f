"""A request the scheduler's sampler cannot serve runs through ``Session.generate``, alone, between two steps.

Its answer is the one-at-a-time answer whatever else runs: the session resumes from the request's pool
namespace and store as a scheduled request does, and ``generate`` runs every option as on the plain path.
A seed is ``torch.manual_seed(seed)`` just before the call: the draw the scheduler's sampler makes with a
generator seeded so (``kvstate.batch.sampling``). Stop strings go to ``generate`` as transformers'
``StopStringCriteria``, built once per stop set (``StopCriteria``), and the server's shutdown deadline as a
criterion that ends the answer at its next token (``Halt``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ..engine import Outcome
from .errors import BadRequest
from .streaming import GenerateStream, Streamer

# The stop-string tables kept for reuse: each is vocabulary x stop length int32 (129 MiB for 4 stops of 32
# characters on a 262k vocabulary), so they are bounded in bytes as well as in number
STOP_TABLES_BYTES = 512 << 20


class StopCriteria:
    """transformers' ``StopStringCriteria`` by stop strings, built once: ``generate(stop_strings=...)`` builds it on
    every call, which reads and sorts the whole vocabulary. It holds tables only, so one serves every request,
    and ``generate`` ORs the criteria it is given with its own: the same stops as ``stop_strings``. The stop sets
    used last are kept, at most 16 and ``STOP_TABLES_BYTES`` of tables. Building one refuses a stop string no
    token spells, as ``generate`` would."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._found: dict[tuple[str, ...], Any] = {}
        self._lock = threading.Lock()

    def get(self, stops: tuple[str, ...]) -> Any:
        from transformers import StopStringCriteria

        with self._lock:
            found = self._found.pop(stops, None) or StopStringCriteria(self.tokenizer, list(stops))
            self._found[stops] = found  # the newest last; the oldest evicted past 16 sets or STOP_TABLES_BYTES
            while len(self._found) > 16 or (len(self._found) > 1 and sum(
                    getattr(c.embedding_vec, "nbytes", 0) for c in self._found.values()) > STOP_TABLES_BYTES):
                self._found.pop(next(iter(self._found)))
        return found


class Halt:
    """A stopping criterion that ends the answer once the server's shutdown deadline passed; ``fired`` says
    whether it did."""

    def __init__(self, halted: threading.Event) -> None:
        self.halted, self.fired = halted, False

    def __deepcopy__(self, memo: dict[int, Any]) -> Halt:  # a copy must watch the same deadline and report here
        return self

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.fired = self.fired or self.halted.is_set()
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)


def generate_alone(run: Callable[..., Outcome], ids: list[int], options: dict[str, Any], seed: int | None,
                   streamer: Streamer, halt: Halt, stops: StopCriteria) -> Outcome:
    """``run(ids, **options)`` (a ``Session.run``) with ``streamer``, the halt and the stop strings as criteria. A
    ``ValueError`` or ``TypeError`` before the first token (transformers checks some options only when
    ``generate`` builds its processors) is the request's mistake: a 400; nothing was committed."""
    options = dict(options)
    options["stopping_criteria"] = [*options.get("stopping_criteria", ()), halt]
    if seed is not None:
        torch.manual_seed(seed)
    try:
        if "stop_strings" in options:  # refused as generate(stop_strings=...) would: no token spells one
            options["stopping_criteria"].append(stops.get(tuple(options.pop("stop_strings"))))
        return run(torch.tensor([ids], dtype=torch.long), streamer=GenerateStream(streamer), **options)
    except (ValueError, TypeError) as exc:
        if streamer.tokens:  # a failure mid-answer is the server's, not the request's
            raise
        raise refused(exc) from exc


def refused(exc: Exception) -> BadRequest:
    """The 400 of generation options that transformers or kvstate refused."""
    return BadRequest(f"invalid generation options: {exc}")
