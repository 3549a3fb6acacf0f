"""Recurrent and hybrid families: Mamba, Mamba2, LFM2, Qwen3-Next, Jamba, Falcon-H1, RecurrentGemma.

Their conv and SSM / linear-attention states cannot be cropped, so ``State`` keeps
checkpoints of them (see ``kvstate.state``). Two transformers 5.24 limitations are
handled here rather than hidden:

* Mamba and Jamba start the selective scan from zeros on any multi-token chunk, and
  RecurrentGemma zero-pads its conv window on multi-token chunks, so a plain multi-token
  continuation after position 0 silently drops state (measured: max |Δlogit| 1.8e-3,
  1.8e-5 and 7.4e-2 on tiny configs). For Mamba and Jamba kvstate hands the scan the
  cached state (``_compat.scan``); RecurrentGemma continues one token per forward
  (``stepwise``), which is exact.
* RecurrentGemma keeps its conv and RG-LRU states on its modules, not in the cache.
  Its adapter moves them between the state and the modules around every forward.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import torch

from .._compat import core
from .._compat.scan import available as scan_available
from .._compat.scan import scans_from_cache
from .._compat.versions import continues_in_chunks
from ..layers import LayerState, RecurrentLayerState
from .base import Adapter, Capabilities


class RecurrentAdapter(Adapter):
    """Families whose recurrent state lives in the transformers cache. ``scan_from_cache`` names the
    transformers modeling module whose selective scan is given the cached state on multi-token
    chunks (``_compat.scan``); where that version has no such scan, chunks go one token per forward."""

    def __init__(self, *, stepwise: bool = False, position_ids: bool = True, scan_from_cache: str | None = None,
                 name: str = "recurrent-hybrid", caps: Capabilities | None = None, family: str | None = None) -> None:
        self._caps = caps or Capabilities(name=name, stepwise=stepwise, position_ids=position_ids, padding=False)
        self._scan_from_cache = scan_from_cache
        self._scans: bool | None = None  # decided on first use: importing the modeling module costs time
        self._chunks = family is None or continues_in_chunks(family)  # the version table in _compat.versions
        self._resolved: Capabilities | None = None

    @property
    def caps(self) -> Capabilities:  # type: ignore[override]
        if self._resolved is None:  # once: the caps are read many times per call
            exact = self._chunks and (self._scan_from_cache is None or self.scans)
            self._resolved = self._caps if exact else replace(self._caps, stepwise=True)
        return self._resolved

    @property
    def scans(self) -> bool:
        """Whether multi-token chunks continue through ``_compat.scan`` in this transformers version."""
        if self._scans is None:
            self._scans = self._scan_from_cache is not None and scan_available(self._scan_from_cache)
        return self._scans

    def forward_context(self, model: torch.nn.Module) -> AbstractContextManager[Any]:
        return scans_from_cache(model) if self._scan_from_cache is not None and self.scans else nullcontext()


class RecurrentGemmaAdapter(RecurrentAdapter):
    """RecurrentGemma: module-held conv1d and RG-LRU states, local attention in the cache.

    The module states are moved in by ``build_cache`` and out by ``read_cache``; the
    engine holds the model's lock around both, so sessions on one model never see
    each other's states.
    """

    def __init__(self) -> None:
        super().__init__(stepwise=True, name="recurrent-gemma")

    def layer_specs(self, model: torch.nn.Module) -> list[tuple[str, int | None]]:
        return core.recurrent_gemma_specs(self.text_config(model))

    def build_cache(self, model: torch.nn.Module, layers: tuple[LayerState, ...], batch_size: int) -> Any:
        cache = super().build_cache(model, tuple(
            RecurrentLayerState({}, {}, 0) if isinstance(layer, RecurrentLayerState) else layer for layer in layers),
            batch_size)
        blocks = core.recurrent_gemma_blocks(model)
        recurrent = [(blocks[i], layer) for i, layer in enumerate(layers) if isinstance(layer, RecurrentLayerState)]
        if any(layer.tokens_seen == 0 for _, layer in recurrent):
            self.zero_modules(model, batch_size)  # never a stale conv window from another conversation
            return cache
        for block, layer in recurrent:
            block.conv1d_state = layer.conv[0].clone()  # the model updates these in place
            block.rg_lru.recurrent_states = layer.recurrent[0].clone()
        return cache

    def read_cache(self, model: torch.nn.Module, cache: Any, layers: tuple[LayerState, ...],
                   positions: torch.Tensor, tokens_seen: int) -> tuple[LayerState, ...]:
        attention = super().read_cache(model, cache, layers, positions, tokens_seen)
        blocks = core.recurrent_gemma_blocks(model)
        return tuple(
            RecurrentLayerState({0: blocks[i].conv1d_state.clone()}, {0: blocks[i].rg_lru.recurrent_states.clone()},
                                tokens_seen) if isinstance(layer, RecurrentLayerState) else new
            for i, (layer, new) in enumerate(zip(layers, attention, strict=True)))

    def zero_modules(self, model: torch.nn.Module, batch_size: int) -> None:
        """Zero the module states before a prefill from an empty state (no stale conv window)."""
        param = next(model.parameters())
        core.recurrent_gemma_zero(model, batch_size, param.device, param.dtype)

    def reset_model(self, model: torch.nn.Module) -> None:
        for block in core.recurrent_gemma_blocks(model):
            if block is not None:
                block.conv1d_state = None
                block.rg_lru.recurrent_states = None
