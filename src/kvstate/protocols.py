"""The seams between kvstate's parts, as small typed Protocols.

* ``ModelAdapter``: what the engine and the session need from a model family
  (``kvstate.adapters.Adapter`` implements it; ``Capabilities`` are values).
* ``StateSource`` / ``StateSink`` (together ``PrefixCache``): what a session needs from
  a prefix store. A store sees states and ``PrefixQuery`` values, never a session.
* ``AttentionObserver``: what a compression policy may ask of the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from .adapters.base import Capabilities
    from .identity import Fingerprint
    from .layers import LayerState
    from .state import State


class ModelAdapter(Protocol):
    """Per-family knowledge (see ``kvstate.adapters.base`` for each method's contract)."""

    caps: Capabilities

    def text_config(self, model: torch.nn.Module) -> Any: ...
    def layer_specs(self, model: torch.nn.Module) -> list[tuple[str, int | None]]: ...
    def empty_layers(self, model: torch.nn.Module, sliding_reserve: int) -> tuple[LayerState, ...]: ...
    def kv_shapes(self, model: torch.nn.Module) -> list[tuple[int, int, int] | None]: ...
    def chunk_positions(self, model: torch.nn.Module, next_position: torch.Tensor, ids: torch.Tensor,
                        new_mask: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor: ...
    def model_positions(self, positions: torch.Tensor) -> torch.Tensor: ...
    def state_positions(self, position_ids: torch.Tensor) -> torch.Tensor: ...
    def select_inputs(self, model: torch.nn.Module, ids: torch.Tensor, processed: int,
                      inputs: dict[str, Any]) -> dict[str, Any]: ...
    def check_inputs(self, model: torch.nn.Module, ids: torch.Tensor, inputs: dict[str, Any],
                     fed_from: int) -> None: ...
    def media_spans(self, model: torch.nn.Module, ids: torch.Tensor,
                    inputs: dict[str, Any] | None = None) -> tuple[tuple[int, int], ...]: ...
    def media_hashes(self, model: torch.nn.Module, ids: torch.Tensor,
                     inputs: dict[str, Any]) -> list[tuple[int, str]] | None: ...
    def build_cache(self, model: torch.nn.Module, layers: tuple[LayerState, ...], batch_size: int) -> Any: ...
    def read_cache(self, model: torch.nn.Module, cache: Any, layers: tuple[LayerState, ...],
                   positions: torch.Tensor, tokens_seen: int) -> tuple[LayerState, ...]: ...
    def empty_cache(self, model: torch.nn.Module, batch_size: int) -> Any: ...
    def cache_kwarg(self, model: torch.nn.Module) -> str: ...
    def lm_output(self, model: torch.nn.Module, logits: torch.Tensor, cache: Any) -> Any: ...
    def prepare(self, model: torch.nn.Module) -> None: ...
    def forward_context(self, model: torch.nn.Module) -> AbstractContextManager[Any]: ...
    def forward_inputs(self, model: torch.nn.Module, before: torch.Tensor, ids: torch.Tensor,
                       inputs: dict[str, Any]) -> dict[str, Any]: ...
    def capture_extras(self, model: torch.nn.Module, next_position: torch.Tensor,
                       tokens_seen: int) -> dict[str, torch.Tensor]: ...
    def restore_extras(self, model: torch.nn.Module, extras: dict[str, torch.Tensor]) -> None: ...
    def reset_model(self, model: torch.nn.Module) -> None: ...


@dataclass(frozen=True)
class PrefixQuery:
    """What identifies a prefix: the model, a history ``tokens`` ``[1, L]`` (CPU), and the
    ``(start slot, content hash)`` of every media item in it."""

    fingerprint: Fingerprint
    tokens: torch.Tensor
    media: tuple[tuple[int, str], ...] = ()


class StateSource(Protocol):
    """Hands out stored prefix states."""

    def lookup(self, query: PrefixQuery, *, longer_than: int, at_most: int) -> State | None:
        """The longest stored prefix of ``query.tokens`` with ``longer_than < length <= at_most``, or None."""
        ...


class StateSink(Protocol):
    """Takes states to store."""

    chunk_tokens: int

    def offer(self, states: Sequence[State], query: PrefixQuery, seconds_per_token: float = 0.0) -> int:
        """Store prefixes of ``states`` (whose media are ``query.media``); returns how many were written."""
        ...


class PrefixCache(StateSource, StateSink, Protocol):
    """A store a ``Session`` reads before planning and offers states to (``kvstate.PrefixStore``)."""


class AttentionObserver(Protocol):
    """What a compression policy may ask of the engine: watched queries and attention (``Engine.observe``)."""

    def observe(self, state: State, ids: torch.Tensor, listener: Any, *, rerun: int = 0,
                chunk_size: int = 512) -> None: ...
