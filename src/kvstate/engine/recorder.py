"""What every forward saw, recorded once (STYLE 16), and the per-model lock every run holds."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .._compat.generation import own_thread
from ..adapters.binding import Runtime
from ..errors import KVStateError

_LOCKS: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: torch.nn.Module) -> threading.RLock:
    """The lock every engine run on ``model`` holds (one per model instance)."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(model, threading.RLock())


@dataclass(frozen=True)
class Forward:
    """One recorded forward: the positions of its tokens ``[B, Q(, R)]`` and its last logits ``[B, V]``."""

    positions: torch.Tensor
    logits: torch.Tensor | None  # None where the forward computed none (``without_logits``)


class Recorder:
    """Records what each forward of a model saw, through hooks that live for one run."""

    def __init__(self, runtime: Runtime, next_position: torch.Tensor) -> None:
        self._runtime = runtime
        self._next = next_position
        self.forwards: list[Forward] = []
        self.current: torch.Tensor | None = None  # positions of the forward running now

    @contextmanager
    def attached(self, model: torch.nn.Module) -> Iterator[Recorder]:
        handles = [model.register_forward_pre_hook(own_thread(self._before), with_kwargs=True),
                   model.register_forward_hook(own_thread(self._after), with_kwargs=True)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _before(self, _module: torch.nn.Module, args: tuple, kwargs: dict[str, object]) -> None:
        given = kwargs.get("position_ids")
        if isinstance(given, torch.Tensor):
            self.current = self._runtime.state_positions(given)
        else:  # families without position ids: consecutive, as their own forward counts
            ids = kwargs.get("input_ids", args[0] if args else None)
            source = ids if isinstance(ids, torch.Tensor) else kwargs["inputs_embeds"]
            q = int(source.shape[1])  # type: ignore[union-attr]
            self.current = self._next[:, None] + torch.arange(q, device=self._next.device)
        flat = self.current.amax(-1) if self.current.dim() == 3 else self.current
        self._next = flat[:, -1] + 1

    def _after(self, _module: torch.nn.Module, _args: tuple, _kwargs: dict[str, object], output: object) -> None:
        assert self.current is not None
        logits = output.logits  # type: ignore[attr-defined]
        last = logits[:, -1, :].detach().clone() if logits is not None and logits.shape[1] else None
        self.forwards.append(Forward(self.current, last))

    def fed(self, n: int) -> Forward:
        """Positions of the first ``n`` recorded tokens, and the logits after the ``n``-th."""
        seen, parts = 0, []
        for forward in self.forwards:
            parts.append(forward.positions)
            seen += forward.positions.shape[1]
            if seen == n:
                return Forward(torch.cat(parts, dim=1), forward.logits)
        raise KVStateError("the model's forwards do not add up to the tokens fed", expected=n, found=seen,
                           fix="report this model with `kvstate verify --model ...`")
