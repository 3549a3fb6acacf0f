"""The structural adapter: any causal decoder whose whole state transformers' cache holds.

No per-family knowledge: each layer's kind and window come from the transformers
cache-layer objects the config builds (``_compat.core.layer_specs``), each layer's K and V
widths from what a forward actually stored, and what the model can do from its
``forward`` signature plus the self-check (``kvstate.selfcheck``), which decides
whether a multi-token continuation is exact, whether only one token per forward is,
and whether cropping is. Family adapters exist only for state outside the cache
(Qwen-VL positions, RecurrentGemma's module states).
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import torch

from .._compat.core import CACHE_KWARG, cache_kwarg, layer_specs
from .._compat.scan import scans_from_cache
from ..errors import UnsupportedModelError
from .base import Adapter, Capabilities


class StructuralAdapter(Adapter):
    """An adapter derived from a model's structure: ``specs`` (kind and window per cache layer)
    and ``kv_shapes`` come from forwards it ran (``_compat.core.observe_layout``, ``selfcheck.kv_shapes``)."""

    def __init__(self, caps: Capabilities, specs: list[tuple[str, int | None]],
                 kv_shapes: list[tuple[int, int, int] | None] | None = None, scan: bool = False) -> None:
        self.caps = caps
        self._specs = list(specs)
        self._kv_shapes = None if kv_shapes is None else list(kv_shapes)
        self._scan = scan  # Mamba-style scans continue from the cached state (the probe proved it exact)

    def layer_specs(self, model: torch.nn.Module) -> list[tuple[str, int | None]]:
        return list(self._specs)

    def kv_shapes(self, model: torch.nn.Module) -> list[tuple[int, int, int] | None]:
        if self._kv_shapes is None:
            raise UnsupportedModelError("the structural adapter's K/V shapes are not measured yet",
                                        expected="an adapter from kvstate.selfcheck.adapter_for", found="none",
                                        fix="use kvstate.selfcheck.adapter_for(model)")
        return list(self._kv_shapes)

    def with_mode(self, *, stepwise: bool, rollback: bool, scan: bool = False) -> StructuralAdapter:
        return StructuralAdapter(replace(self.caps, stepwise=stepwise, rollback=rollback), self._specs,
                                 self._kv_shapes, scan)

    def with_kv_shapes(self, kv_shapes: list[tuple[int, int, int] | None]) -> StructuralAdapter:
        return StructuralAdapter(self.caps, self._specs, kv_shapes, self._scan)

    def forward_context(self, model: torch.nn.Module) -> AbstractContextManager[Any]:
        return scans_from_cache(model) if self._scan else nullcontext()


def structural_caps(model: torch.nn.Module) -> Capabilities:
    """What the model's signature and cache layout allow, before any self-check.

    Raises ``UnsupportedModelError`` for models kvstate cannot hold exactly whatever the
    check would find: no transformers cache in ``forward``, an encoder-decoder, a
    cache-layer class kvstate does not know, dynamic sparse (top-k) attention, or a
    ``generate`` of the model's own.
    """
    config = model.config  # type: ignore[union-attr]
    model_type = str(getattr(config, "model_type", type(model).__name__))
    params = inspect.signature(model.forward).parameters
    if cache_kwarg(model) is None:
        raise UnsupportedModelError(f"{model_type} does not take a transformers cache in forward()",
                                    expected=f"a forward with a `{CACHE_KWARG}` argument",
                                    found=", ".join(list(params)[:8]), fix="kvstate cannot hold this model's state")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{model_type} is an encoder-decoder", expected="a decoder-only causal LM",
                                    found="config.is_encoder_decoder = True",
                                    fix="kvstate holds decoder state only; use the model's ForCausalLM decoder")
    kinds = [kind for kind, _ in layer_specs(config.get_text_config(decoder=True))]
    if "indexed_attention" in kinds:
        raise UnsupportedModelError(
            f"{model_type} uses dynamic sparse attention", expected="attention over every stored slot",
            found="indexed_attention layers: an indexer picks the top-k keys per query",
            fix="a last-bit difference between a chunked and a whole prefill can change which keys the top-k "
            "reads, so a resumed state cannot promise the fresh run's tokens; register an Adapter for this "
            "model_type only if that is acceptable (kvstate holds its indexer keys exactly)")
    _refuse_own_generate(model, model_type)
    positions = "position_ids" in params
    # a left-padded row keeps its logical positions only through explicit position_ids; a model that
    # counts positions from the cache length (whisper's decoder) would shift every padded row. Per-head
    # masks are unproven on a family kvstate has not examined: compression keeps one slot set per layer
    return Capabilities(name=f"structural:{model_type}", position_ids=positions,
                        padding=positions and not any(k in ("recurrent", "hybrid") for k in kinds),
                        logits_to_keep="logits_to_keep" in params,
                        stepwise=any(k in ("recurrent", "hybrid") for k in kinds), head_masks=False)


def _refuse_own_generate(model: torch.nn.Module, model_type: str) -> None:
    """A model class with its own ``generate`` may rewrite the prompt before the forward sees it
    (MusicGen shifts each codebook by a delay pattern and puts BOS at position 0), so a state of
    the prompt's forward cannot stand in for what that ``generate`` computes."""
    from transformers.generation.utils import GenerationMixin

    own = getattr(type(model), "generate", GenerationMixin.generate)
    if own is not GenerationMixin.generate:
        raise UnsupportedModelError(
            f"{model_type} has its own generate()", expected="transformers' GenerationMixin.generate",
            found=f"{own.__qualname__}, which can rewrite the prompt before the model sees it",
            fix="kvstate resumes the standard generate only; register an Adapter for this model_type if its "
            "generate feeds the prompt unchanged")
