"""Per-family knowledge, behind one explicit registry.

An ``Adapter`` answers the questions that differ between model families: which
config describes the decoder, which layer kinds it has, and which model-side
values (outside any cache) belong to the state. The generic adapter covers
standard decoder-only models whose only state is attention K/V. Families are
registered by ``model_type``; anything unregistered raises ``UnsupportedModelError``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import _compat
from .errors import UnsupportedModelError
from .layers import AttentionLayerState, LayerState


class Adapter:
    """Generic decoder-only family: attention K/V is the whole state."""

    name = "generic-decoder"

    def text_config(self, model: torch.nn.Module) -> object:
        return model.config.get_text_config(decoder=True)  # type: ignore[union-attr,operator]

    def empty_layers(self, model: torch.nn.Module, sliding_reserve: int) -> tuple[LayerState, ...]:
        """One empty per-layer state per decoder layer, kinds taken from the config."""
        return tuple(AttentionLayerState.empty(window, sliding_reserve if window else 0)
                     for _kind, window in _compat.layer_specs(self.text_config(model)))

    def kv_shape(self, model: torch.nn.Module) -> tuple[int, int]:
        """``(H, D)``: KV heads and head dim of the attention layers' K/V."""
        config = self.text_config(model)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads  # type: ignore[attr-defined]
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)  # type: ignore[attr-defined]
        return int(heads), int(head_dim)

    def capture_extras(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Model-side values to store in the state after a forward."""
        return {}

    def restore_extras(self, model: torch.nn.Module, extras: Mapping[str, torch.Tensor]) -> None:
        """Put the state's model-side values back on the model before a forward."""

    def reset_model(self, model: torch.nn.Module) -> None:
        """Clear model-side values so the model behaves as freshly loaded."""


_REGISTRY: dict[str, Adapter] = {}


def register(model_types: tuple[str, ...], adapter: Adapter) -> None:
    """Register ``adapter`` for each ``model_type``."""
    for model_type in model_types:
        _REGISTRY[model_type] = adapter


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def adapter_for(model: torch.nn.Module) -> Adapter:
    """The adapter registered for ``model.config.model_type``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    adapter = _REGISTRY.get(str(model_type))
    if adapter is None:
        raise UnsupportedModelError(
            f"no kvstate adapter for model_type {model_type!r}",
            expected="one of " + ", ".join(supported_model_types()), found=model_type,
            fix="use a supported family, or register an Adapter with kvstate.adapters.register")
    return adapter


# Each of these is exercised by the test matrix (tests/test_core.py).
register(("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"), Adapter())
