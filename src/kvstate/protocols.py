"""The seams between kvstate's parts, as small typed Protocols and aliases.

* ``ModelAdapter``: per-family knowledge, model-first (``kvstate.adapters.Adapter``).
  Nobody calls it directly but ``kvstate.adapters.binding``, which binds it to one
  model and splits it into ``StateLayout`` (for whoever adopts or validates a state),
  ``RequestInputs`` (validation and planning) and ``ModelRuntime`` (the engine only).
* ``StateSource`` / ``StateSink`` (together ``PrefixCache``): where prefixes come from
  and go to. A session's own state, the server's pool and a ``PrefixStore`` all answer
  ``lookup``; ``kvstate.resume`` picks among them with one prefix function.
* ``AttentionObserver`` and ``SlotPolicy``: what a compression policy may ask of the
  engine, and what the engine's budgeted schedule asks of a budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from transformers.cache_utils import Cache
    from transformers.utils import ModelOutput as HFModelOutput

    from .capabilities import Capabilities
    from .identity import Fingerprint
    from .layers import LayerState
    from .state import State

# A transformers cache (``DynamicCache``, or a family's own: RWKV's state list, xLSTM's cache).
HFCache: TypeAlias = "Cache | object"
# What a model's forward returns (``CausalLMOutputWithPast`` or a family's own output class).
ModelOutput: TypeAlias = "HFModelOutput"
# Extra model inputs tied to token slots, by keyword (``pixel_values``, ``image_grid_thw``, ...).
ModelInputs: TypeAlias = Mapping[str, torch.Tensor]
# ``[start, end)`` slot ranges of media items; a resume or a chunk never splits one.
MediaSpans: TypeAlias = tuple[tuple[int, int], ...]
# ``listener(first_key, watched)``: one attention call of a watched forward (``kvstate._compat.watch.Watched``).
AttentionListener: TypeAlias = Callable[[int, Any], None]


class ModelAdapter(Protocol):
    """Per-family knowledge (see ``kvstate.adapters.base`` for each method's contract)."""

    caps: Capabilities

    def text_config(self, model: torch.nn.Module) -> PretrainedConfig: ...
    def layer_specs(self, model: torch.nn.Module) -> list[tuple[str, int | None]]: ...
    def empty_layers(self, model: torch.nn.Module, sliding_reserve: int) -> tuple[LayerState, ...]: ...
    def kv_shapes(self, model: torch.nn.Module) -> list[tuple[int, int, int] | None]: ...
    def chunk_positions(self, model: torch.nn.Module, next_position: torch.Tensor, ids: torch.Tensor,
                        new_mask: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor: ...
    def model_positions(self, positions: torch.Tensor) -> torch.Tensor: ...
    def state_positions(self, position_ids: torch.Tensor) -> torch.Tensor: ...
    def select_inputs(self, model: torch.nn.Module, ids: torch.Tensor, processed: int,
                      inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...
    def inputs_until(self, model: torch.nn.Module, ids: torch.Tensor, end: int,
                     inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...
    def check_inputs(self, model: torch.nn.Module, ids: torch.Tensor, inputs: dict[str, torch.Tensor],
                     fed_from: int) -> None: ...
    def media_spans(self, model: torch.nn.Module, ids: torch.Tensor,
                    inputs: dict[str, torch.Tensor] | None = None) -> MediaSpans: ...
    def media_hashes(self, model: torch.nn.Module, ids: torch.Tensor,
                     inputs: dict[str, torch.Tensor]) -> list[tuple[int, str]] | None: ...
    def build_cache(self, model: torch.nn.Module, layers: tuple[LayerState, ...], batch_size: int) -> HFCache: ...
    def read_cache(self, model: torch.nn.Module, cache: HFCache, layers: tuple[LayerState, ...],
                   positions: torch.Tensor, tokens_seen: int) -> tuple[LayerState, ...]: ...
    def empty_cache(self, model: torch.nn.Module, batch_size: int) -> HFCache: ...
    def cache_kwarg(self, model: torch.nn.Module) -> str: ...
    def lm_output(self, model: torch.nn.Module, logits: torch.Tensor, cache: HFCache) -> ModelOutput: ...
    def prepare(self, model: torch.nn.Module) -> None: ...
    def forward_context(self, model: torch.nn.Module) -> AbstractContextManager[object]: ...
    def forward_inputs(self, model: torch.nn.Module, before: torch.Tensor, ids: torch.Tensor,
                       inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...
    def capture_extras(self, model: torch.nn.Module, next_position: torch.Tensor,
                       tokens_seen: int) -> dict[str, torch.Tensor]: ...
    def restore_extras(self, model: torch.nn.Module, extras: dict[str, torch.Tensor]) -> None: ...
    def reset_model(self, model: torch.nn.Module) -> None: ...


class StateLayout(Protocol):
    """A state's shape for one model (``Binding.layout``)."""

    @property
    def caps(self) -> Capabilities: ...
    def empty_layers(self, sliding_reserve: int) -> tuple[LayerState, ...]: ...
    def kv_shapes(self) -> list[tuple[int, int, int] | None]: ...
    def check(self, state: State) -> None: ...


class RequestInputs(Protocol):
    """What a request's ids and model inputs mean for one model (``Binding.inputs``)."""

    @property
    def keys(self) -> tuple[str, ...]: ...
    def positions(self, next_position: torch.Tensor, ids: torch.Tensor, new_mask: torch.Tensor,
                  inputs: ModelInputs) -> torch.Tensor: ...
    def model_positions(self, positions: torch.Tensor) -> torch.Tensor: ...
    def spans(self, ids: torch.Tensor, inputs: ModelInputs | None = None) -> MediaSpans: ...
    def hashes(self, ids: torch.Tensor, inputs: ModelInputs) -> list[tuple[int, str]] | None: ...
    def select(self, ids: torch.Tensor, processed: int, inputs: ModelInputs) -> ModelInputs: ...
    def until(self, ids: torch.Tensor, end: int, inputs: ModelInputs) -> ModelInputs: ...
    def check(self, ids: torch.Tensor, inputs: ModelInputs, fed_from: int) -> None: ...


class LiveCache(Protocol):
    """A state attached to the model (``ModelRuntime.attached``)."""

    cache: HFCache

    def read(self, positions: torch.Tensor, tokens_seen: int,
             next_position: torch.Tensor) -> tuple[tuple[LayerState, ...], dict[str, torch.Tensor]]: ...


class ModelRuntime(Protocol):
    """Moving state in and out of one model; the engine's only (``Binding.runtime``)."""

    @property
    def cache_kwarg(self) -> str: ...
    def attached(self, state: State) -> AbstractContextManager[LiveCache]: ...
    def restore(self, extras: Mapping[str, torch.Tensor]) -> None: ...
    def empty_cache(self, batch_size: int) -> HFCache: ...
    def lm_output(self, logits: torch.Tensor, cache: HFCache) -> ModelOutput: ...
    def forward_inputs(self, before: torch.Tensor, ids: torch.Tensor, inputs: ModelInputs) -> ModelInputs: ...
    def forward_context(self) -> AbstractContextManager[object]: ...
    def model_positions(self, positions: torch.Tensor) -> torch.Tensor: ...
    def state_positions(self, position_ids: torch.Tensor) -> torch.Tensor: ...
    def reset(self) -> None: ...


@dataclass(frozen=True)
class PrefixQuery:
    """What identifies a prefix: the model, a history ``tokens`` ``[1, L]`` (CPU), and the
    ``(start slot, content hash)`` of every media item in it."""

    fingerprint: Fingerprint
    tokens: torch.Tensor
    media: tuple[tuple[int, str], ...] = ()


class StateSource(Protocol):
    """Hands out states whose tokens start the query's history; ``name`` is what ``ResumePlan.source``
    calls it (``store``, ``pool``)."""

    name: str

    def lookup(self, query: PrefixQuery, *, longer_than: int, at_most: int) -> State | None:
        """A state sharing more than ``longer_than`` (and at most ``at_most``) leading tokens with
        ``query.tokens``, the longest it has; or None."""
        ...


class StateSink(Protocol):
    """Takes states to keep."""

    def offer(self, states: Sequence[State], query: PrefixQuery, seconds_per_token: float = 0.0) -> int:
        """Keep (prefixes of) ``states``, whose media are ``query.media``; returns how many were kept."""
        ...


class PrefixCache(StateSource, StateSink, Protocol):
    """A source that is also a sink (``kvstate.PrefixStore``, the server's pool)."""


class AttentionObserver(Protocol):
    """What a compression policy may ask of the engine: watched queries and attention (``Engine.observe``),
    and what the family can do (per-head masks, positions)."""

    @property
    def caps(self) -> Capabilities: ...
    def observe(self, state: State, ids: torch.Tensor, listener: AttentionListener, *, rerun: int = 0,
                chunk_size: int = 512, fresh: bool = False, weights: bool = True, norms: bool = False) -> None: ...


class SlotPolicy(Protocol):
    """What the engine's budgeted schedule asks of its budget (``kvstate.compress.during.Budget``)."""

    def compress_to(self, observer: AttentionObserver, model: torch.nn.Module, state: State,
                    budget: int) -> State: ...
