"""The ``Adapter`` protocol, its generic implementation, and the registry.

An adapter answers the questions that differ between model families: which config
describes the decoder, which layer kinds it has, how positions are assigned to new
slots, which model inputs belong to unprocessed tokens, how its state is moved in
and out of a transformers cache, and which model-side values (outside any cache)
belong to the state. What an adapter can do is declared once, as ``Capabilities``
values the planner and the engine read; nothing probes with ``hasattr``.
The generic adapter covers standard decoder-only models. Families are registered
by ``model_type``; any other causal decoder gets the structural adapter
(``structural``) once it passes the self-check (``kvstate.selfcheck``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from .._compat import core, generation
from ..capabilities import Capabilities
from ..layers import (
    AttentionLayerState,
    HybridLayerState,
    IndexedLayerState,
    LayerState,
    RecurrentLayerState,
    StatelessLayerState,
)
from .media import StrayPlaceholders


class Adapter:
    """Generic decoder-only family: 1-D positions, state entirely in the cache."""

    caps = Capabilities()

    def text_config(self, model: torch.nn.Module) -> Any:
        return model.config.get_text_config(decoder=True)  # type: ignore[union-attr,operator]

    def layer_specs(self, model: torch.nn.Module) -> list[tuple[str, int | None]]:
        """``(kind, window)`` per cache layer, as the config declares them."""
        return core.layer_specs(self.text_config(model))

    def empty_layers(self, model: torch.nn.Module, sliding_reserve: int) -> tuple[LayerState, ...]:
        """One empty per-layer state per cache layer (``layer_specs``)."""
        layers = []
        for kind, window in self.layer_specs(model):
            attention = AttentionLayerState.empty(window, sliding_reserve if window else 0)
            layers.append(_EMPTY.get(kind, _attention_only)(attention))
        return tuple(layers)

    def kv_shapes(self, model: torch.nn.Module) -> list[tuple[int, int, int] | None]:
        """Per layer, ``(H, D_k, D_v)`` of the K/V it stores (None: the layer holds no K/V)."""
        config = self.text_config(model)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return [(int(heads), int(head_dim), int(head_dim)) if kind in ("full_attention", "sliding_attention", "hybrid")
                else None for kind, _ in self.layer_specs(model)]

    # ----- positions and inputs ------------------------------------------------------
    def chunk_positions(self, model: torch.nn.Module, next_position: torch.Tensor, ids: torch.Tensor,
                        new_mask: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """Logical positions ``[B, Q]`` of new slots: consecutive over real slots, pads at 0."""
        positions = next_position[:, None] + new_mask.long().cumsum(-1) - 1
        return positions.masked_fill(~new_mask, 0)

    def model_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The ``position_ids`` the model takes for stored positions ``[B, Q(, R)]``."""
        return positions

    def state_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Stored positions ``[B, Q(, R)]`` of the ``position_ids`` a forward received."""
        return position_ids

    def select_inputs(self, model: torch.nn.Module, ids: torch.Tensor, processed: int,
                      inputs: dict[str, Any]) -> dict[str, Any]:
        """The extra model inputs that belong to tokens after ``processed`` slots."""
        return inputs

    def inputs_until(self, model: torch.nn.Module, ids: torch.Tensor, end: int,
                     inputs: dict[str, Any]) -> dict[str, Any]:
        """Of ``inputs`` (which belong to ``ids`` ``[B, L]``), those of the media items starting before
        slot ``end``: a canonical chunk ends there, after whole items only (the canonical schedule)."""
        return inputs

    def check_inputs(self, model: torch.nn.Module, ids: torch.Tensor, inputs: dict[str, Any], fed_from: int) -> None:
        """Raise a typed error unless ``inputs`` fit ``ids`` ``[B, L]``, of which slots from ``fed_from`` on
        go through the model (the media they hold must be given)."""

    def stray_placeholders(self, model: torch.nn.Module, ids: torch.Tensor) -> list[StrayPlaceholders]:
        """Per media kind, the placeholder ids of ``ids`` ``[B, L]`` outside every item a processor laid out
        (``kvstate.request`` refuses them next to that kind's pixels); none for text-only families."""
        return []

    def media_spans(self, model: torch.nn.Module, ids: torch.Tensor,
                    inputs: dict[str, Any] | None = None) -> tuple[tuple[int, int], ...]:
        """``[start, end)`` slot ranges of multimodal items in ``ids`` ``[B, L]``; a resume never splits one."""
        return ()

    def synthetic_image(self, model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """``(placeholder ids [1, n], image inputs)`` for verify's multimodal rows; None if text-only."""
        return None

    def image_tokens(self, model: torch.nn.Module) -> tuple[int, int, int] | None:
        """``(start, placeholder, end)`` ids a prompt writes for one image (the placeholder repeated once
        per image token), for renderers that build prompts (``kvstate serve``); None without images."""
        return None

    def synthetic_video(self, model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, Any]] | None:
        """``(placeholder ids [1, n], video inputs)`` for verify's video rows; None without video."""
        return None

    def plain_inputs(self, model: torch.nn.Module, ids: torch.Tensor, inputs: dict[str, Any]) -> dict[str, Any]:
        """What plain transformers needs besides ``inputs`` to process ``ids`` from scratch."""
        return inputs

    def media_hashes(self, model: torch.nn.Module, ids: torch.Tensor,
                     inputs: dict[str, Any]) -> list[tuple[int, str]] | None:
        """``(start slot, content hash)`` of each media item in ``ids`` ``[1, L]``; None if unknown."""
        return []

    # ----- moving state in and out of the model -------------------------------------------
    def build_cache(self, model: torch.nn.Module, layers: tuple[LayerState, ...], batch_size: int) -> Any:
        return core.build_cache(layers, self.text_config(model))

    def read_cache(self, model: torch.nn.Module, cache: Any, layers: tuple[LayerState, ...],
                   positions: torch.Tensor, tokens_seen: int) -> tuple[LayerState, ...]:
        return core.read_cache(cache, layers, positions, tokens_seen)

    def empty_cache(self, model: torch.nn.Module, batch_size: int) -> Any:
        """The cache ``generate`` is called with; the replaced prefill hands it the real one."""
        return core.empty_cache(self.text_config(model))

    def cache_kwarg(self, model: torch.nn.Module) -> str:
        """The keyword the cache travels in, for ``forward`` and ``generate``."""
        return self.caps.cache_kwarg or core.cache_kwarg(model) or core.CACHE_KWARG

    def lm_output(self, model: torch.nn.Module, logits: torch.Tensor, cache: Any) -> Any:
        """The model output ``generate``'s replaced prefill returns: ``logits`` ``[B, 1, V]`` and the cache."""
        return generation.lm_output(logits, cache, self.cache_kwarg(model))

    def forward_inputs(self, model: torch.nn.Module, before: torch.Tensor, ids: torch.Tensor,
                       inputs: dict[str, Any]) -> dict[str, Any]:
        """The extra inputs of one forward of ``ids`` ``[B, Q]`` after the processed tokens ``before``
        ``[B, T]`` (Gemma 3 needs the token types of the whole history)."""
        return inputs

    def forward_context(self, model: torch.nn.Module) -> AbstractContextManager[Any]:
        """Entered around every forward kvstate runs (under the model's lock)."""
        return nullcontext()

    def prepare(self, model: torch.nn.Module) -> None:
        """Bring the model to the form its first inference forward would (idempotent), so the weights
        fingerprinted before any forward are the weights every forward uses."""

    def capture_extras(self, model: torch.nn.Module, next_position: torch.Tensor,
                       tokens_seen: int) -> dict[str, torch.Tensor]:
        """Model-side values to store in the state after a forward."""
        return {}

    def restore_extras(self, model: torch.nn.Module, extras: dict[str, torch.Tensor]) -> None:
        """Put the state's model-side values back on the model before a forward."""

    def reset_model(self, model: torch.nn.Module) -> None:
        """Clear model-side values so the model behaves as freshly loaded."""


def _attention_only(attention: AttentionLayerState) -> LayerState:
    return attention


# the empty state of each layer kind, given the empty attention part its window asks for
_EMPTY: dict[str, Callable[[AttentionLayerState], LayerState]] = {
    "recurrent": lambda _attention: RecurrentLayerState({}, {}, 0),
    "hybrid": lambda attention: HybridLayerState(attention, RecurrentLayerState({}, {}, 0)),
    "indexed_attention": lambda attention: IndexedLayerState(attention, None),
    "stateless": lambda _attention: StatelessLayerState(0),
}
_REGISTRY: dict[str, Adapter] = {}


def register(model_types: tuple[str, ...], adapter: Adapter) -> None:
    """Register ``adapter`` for each ``model_type``."""
    for model_type in model_types:
        _REGISTRY[model_type] = adapter


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def registered_type(model_type: str) -> Adapter | None:
    """The adapter registered for ``model_type``, if any."""
    return _REGISTRY.get(model_type)


def registered(model: torch.nn.Module) -> Adapter | None:
    """The adapter registered for ``model.config.model_type``, if any (else the self-check decides)."""
    return _REGISTRY.get(str(getattr(getattr(model, "config", None), "model_type", None)))
