"""An adapter bound to one model: three small views, each for one kind of caller (core v3).

``Adapter`` methods take the model as their first argument and answer for a whole
family. A ``Binding`` fixes the model once and splits the answers by who needs them:

* ``layout`` - the state's shape: capabilities, empty layers, K/V head shapes, and
  the check that a state (from a file, a store or a pool) fits this model. For whoever
  adopts or validates a state.
* ``inputs`` - what a request means: logical positions of new tokens, media spans and
  content hashes, which model inputs belong to unprocessed tokens, input checks. For
  validation and planning.
* ``runtime`` - moving state in and out of the model, used only by the engine:
  ``with runtime.attached(state) as live: ...; live.read(...)`` builds the transformers
  cache, restores the model-side extras (Qwen-VL ``rope_deltas``) and reads both back,
  in one place.

A binding is a frozen value: the same model and the same adapter for its whole life.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import LayoutMismatchError
from ..layers import LayerState
from .base import Adapter, Capabilities
from .media import StrayPlaceholders

if TYPE_CHECKING:
    from ..protocols import HFCache, MediaSpans, ModelInputs, ModelOutput
    from ..state import State


@dataclass(frozen=True)
class _Bound:
    """An adapter and the one model it answers for; every view below is one."""

    adapter: Adapter
    model: torch.nn.Module

    @property
    def caps(self) -> Capabilities:
        return self.adapter.caps


@dataclass(frozen=True)
class Layout(_Bound):
    """The state's shape for one model (see the module docstring)."""

    def empty_layers(self, sliding_reserve: int) -> tuple[LayerState, ...]:
        return self.adapter.empty_layers(self.model, sliding_reserve)

    def kv_shapes(self) -> list[tuple[int, int, int] | None]:
        """Per layer, ``(H, D_k, D_v)`` of the K/V it stores (None: no K/V)."""
        return self.adapter.kv_shapes(self.model)

    def check(self, state: State) -> None:
        """Raise ``LayoutMismatchError`` unless ``state``'s layers are this model's: kinds, windows, heads."""
        expected = [(layer.kind, layer.meta().get("window")) for layer in self.empty_layers(0)]
        found = [(layer.kind, layer.meta().get("window")) for layer in state.layers]
        if found != expected:
            raise LayoutMismatchError("state layers do not match the model's layers",
                                      expected=f"{len(expected)} layers {expected}",
                                      found=f"{len(found)} layers {found}",
                                      fix="load the state into the model it was made with")
        keyed = [(i, layer.tensors()) for i, layer in enumerate(state.layers) if "keys" in layer.tensors()]
        shapes = self.kv_shapes() if keyed else []
        for i, tensors in keyed:
            heads = (tensors["keys"].shape[1], tensors["keys"].shape[3], tensors["values"].shape[3])
            if shapes[i] is not None and heads != shapes[i]:
                raise LayoutMismatchError(f"layer {i} K/V head shape differs from the model's",
                                          expected=f"(kv_heads, key dim, value dim) = {shapes[i]}", found=heads,
                                          fix="load the state into the model it was made with")


@dataclass(frozen=True)
class InputRules(_Bound):
    """What a request's ids and model inputs mean for one model (see the module docstring)."""

    @property
    def keys(self) -> tuple[str, ...]:
        """Extra model inputs tied to token slots (e.g. ``pixel_values``)."""
        return self.adapter.caps.input_keys

    def positions(self, next_position: torch.Tensor, ids: torch.Tensor, new_mask: torch.Tensor,
                  inputs: ModelInputs) -> torch.Tensor:
        """Logical positions ``[B, Q(, R)]`` of new tokens ``ids`` ``[B, Q]`` after ``next_position`` ``[B]``."""
        return self.adapter.chunk_positions(self.model, next_position, ids, new_mask, dict(inputs))

    def model_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The ``position_ids`` the model takes for stored positions ``[B, Q(, R)]``."""
        return self.adapter.model_positions(positions)

    def spans(self, ids: torch.Tensor, inputs: ModelInputs | None = None) -> MediaSpans:
        """``[start, end)`` slot ranges of media items in ``ids`` ``[B, L]``; never split."""
        return self.adapter.media_spans(self.model, ids, None if inputs is None else dict(inputs))

    def hashes(self, ids: torch.Tensor, inputs: ModelInputs) -> list[tuple[int, str]] | None:
        """``(start slot, content hash)`` per media item of ``ids`` ``[1, L]``; None if unknown."""
        return self.adapter.media_hashes(self.model, ids, dict(inputs))

    def select(self, ids: torch.Tensor, processed: int, inputs: ModelInputs) -> ModelInputs:
        """The model inputs that belong to the slots of ``ids`` ``[B, L]`` after ``processed``."""
        return self.adapter.select_inputs(self.model, ids, processed, dict(inputs))

    def until(self, ids: torch.Tensor, end: int, inputs: ModelInputs) -> ModelInputs:
        """Of ``inputs`` (belonging to ``ids`` ``[B, L]``), those of the media items starting before ``end``."""
        return self.adapter.inputs_until(self.model, ids, end, dict(inputs))

    def check(self, ids: torch.Tensor, inputs: ModelInputs, fed_from: int) -> None:
        """Raise a typed error unless ``inputs`` fit ``ids``, of which slots from ``fed_from`` on are fed."""
        self.adapter.check_inputs(self.model, ids, dict(inputs), fed_from)

    def strays(self, ids: torch.Tensor) -> list[StrayPlaceholders]:
        """Per media kind, its placeholder ids in ``ids`` ``[B, L]`` outside every item a processor laid out."""
        return self.adapter.stray_placeholders(self.model, ids)

    def image_tokens(self) -> tuple[int, int, int] | None:
        """``(start, placeholder, end)`` ids a prompt writes for one image; None without images."""
        return self.adapter.image_tokens(self.model)


class Live:
    """A transformers cache holding a state's layers, attached to the model for one forward or one
    ``generate`` (see ``Runtime.attached``)."""

    def __init__(self, runtime: Runtime, state: State, cache: HFCache) -> None:
        self._runtime, self._state, self.cache = runtime, state, cache

    def read(self, positions: torch.Tensor, tokens_seen: int,
             next_position: torch.Tensor) -> tuple[tuple[LayerState, ...], dict[str, torch.Tensor]]:
        """The layers after the model appended tokens at ``positions`` ``[B, Q(, R)]`` (``tokens_seen`` in
        all), and the model-side extras after them (``next_position`` ``[B]``)."""
        runtime = self._runtime
        layers = runtime.adapter.read_cache(runtime.model, self.cache, self._state.layers, positions, tokens_seen)
        return layers, runtime.adapter.capture_extras(runtime.model, next_position, tokens_seen)


@dataclass(frozen=True)
class Runtime(_Bound):
    """Moves state in and out of one model; only the engine uses it (see the module docstring)."""

    @property
    def cache_kwarg(self) -> str:
        """The keyword the cache travels in, for ``forward`` and ``generate``."""
        return self.adapter.cache_kwarg(self.model)

    @contextmanager
    def attached(self, state: State) -> Iterator[Live]:
        """A cache built from ``state``'s layers, with ``state``'s model-side extras on the model."""
        cache = self.adapter.build_cache(self.model, state.layers, state.batch_size)
        self.restore(state.extras)
        yield Live(self, state, cache)

    def restore(self, extras: Mapping[str, torch.Tensor]) -> None:
        """Put model-side values back on the model, so the instance agrees with a state."""
        self.adapter.restore_extras(self.model, dict(extras))

    def empty_cache(self, batch_size: int) -> HFCache:
        """The placeholder cache ``generate`` is called with (the replaced prefill hands it the real one)."""
        return self.adapter.empty_cache(self.model, batch_size)

    def lm_output(self, logits: torch.Tensor, cache: HFCache) -> ModelOutput:
        """An output holding last-position ``logits`` ``[B, 1, V]`` and ``cache``."""
        return self.adapter.lm_output(self.model, logits, cache)

    def forward_inputs(self, before: torch.Tensor, ids: torch.Tensor, inputs: ModelInputs) -> ModelInputs:
        """Extra inputs of one forward of ``ids`` ``[B, Q]`` after the processed ``before`` ``[B, T]``."""
        return self.adapter.forward_inputs(self.model, before, ids, dict(inputs))

    def forward_context(self) -> AbstractContextManager[object]:
        """Entered around every forward (under the model's lock)."""
        return self.adapter.forward_context(self.model)

    def model_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return self.adapter.model_positions(positions)

    def state_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Stored positions ``[B, Q(, R)]`` of the ``position_ids`` a forward received."""
        return self.adapter.state_positions(position_ids)

    def reset(self) -> None:
        """Clear model-side values, as on a freshly loaded instance."""
        self.adapter.reset_model(self.model)


@dataclass(frozen=True)
class Binding(_Bound):
    """One model and its adapter, seen through ``layout``, ``inputs`` and ``runtime``."""

    @property
    def layout(self) -> Layout:
        return Layout(self.adapter, self.model)

    @property
    def inputs(self) -> InputRules:
        return InputRules(self.adapter, self.model)

    @property
    def runtime(self) -> Runtime:
        return Runtime(self.adapter, self.model)


def bound(model: torch.nn.Module, adapter: Adapter) -> Binding:
    """``adapter`` bound to ``model`` (``kvstate.selfcheck.bind`` chooses the adapter)."""
    return Binding(adapter, model)

