"""Exact attention masks for states whose layers hold different slots (after compression).

transformers builds one mask per layer *type* from the first layer of that type, so
layers with different lengths or different retained slots get a wrong mask
(transformers issue 35168). While a compressed state is in use, kvstate hands every
attention layer its own mask through a pre-hook on the decoder layer, installed in
a context manager and removed in ``finally``. A key is visible to a query when:

* 1-D positions: ``pos_key <= pos_query`` (and ``pos_query - pos_key < window`` for
  sliding layers), computed from the logical position of every stored slot;
* multimodal positions (M-RoPE): every retained slot, and the new slots causally
  by index (M-RoPE positions are not ordered).

Masks are boolean for sdpa and additive (0 / dtype min) for eager; other backends
raise ``UnsupportedError`` rather than attend to the wrong slots.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ._compat.attention import mask_format
from ._compat.core import attention_implementation, decoder_layers
from ._compat.generation import own_thread
from .errors import UnsupportedError
from .layers import AttentionLayerState, LayerState

_BACKENDS = ("sdpa", "eager")


def needs_masks(layers: tuple[LayerState, ...]) -> bool:
    return any(isinstance(layer, AttentionLayerState) and layer.compressed for layer in layers)


@contextmanager
def layer_masks(model: Any, layers: tuple[LayerState, ...], queries: Any) -> Iterator[None]:
    """Give each attention layer its own mask while ``model`` runs from ``layers``.

    ``queries.current`` holds the positions ``[B, Q(, R)]`` of the tokens in the forward
    that is running (the engine's ``Recorder`` sets it before the decoder runs).
    """
    backend = mask_format(attention_implementation(model))
    if backend not in _BACKENDS:
        raise UnsupportedError("compressed states need per-layer masks", expected=_BACKENDS, found=backend,
                               fix="load the model with attn_implementation='sdpa' or 'eager'")
    plan = _Plan(layers, queries, backend)
    handles = []
    try:
        for i, decoder_layer in enumerate(decoder_layers(model)):
            if isinstance(layers[i], AttentionLayerState):
                handles.append(decoder_layer.register_forward_pre_hook(own_thread(plan.layer_hook(i)),
                                                                       with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


class _Plan:
    """Key positions per layer, extended forward by forward."""

    def __init__(self, layers: tuple[LayerState, ...], queries: Any, backend: str) -> None:
        self.keys = {i: layer.positions for i, layer in enumerate(layers)
                     if isinstance(layer, AttentionLayerState)}
        self.windows = {i: layer.window for i, layer in enumerate(layers) if isinstance(layer, AttentionLayerState)}
        self.queries = queries
        self.backend = backend

    def layer_hook(self, i: int) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
            query = self.queries.current
            old, window = self.keys[i], self.windows[i]
            keys = query if old is None else torch.cat([old, query], dim=1)
            self.keys[i] = keys
            if window is not None:  # transformers' sliding layers hand attention only the last W - 1 + Q slots
                keys = keys[:, -(window - 1 + query.shape[1]):]
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            return _with_mask(module, args, kwargs, self._mask(keys, query, window, hidden.dtype))

        return hook

    def _mask(self, keys: torch.Tensor, queries: torch.Tensor, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """``[B, 1, Q, K]``: which stored or new slots each query may attend to."""
        if keys.dim() == 2:
            visible = keys[:, None, :] <= queries[:, :, None]
            if window is not None:
                visible &= queries[:, :, None] - keys[:, None, :] < window
        else:  # M-RoPE positions are not ordered: retained slots all visible, new ones causal by index
            B, K, Q = keys.shape[0], keys.shape[1], queries.shape[1]
            causal = torch.ones(Q, Q, dtype=torch.bool, device=keys.device).tril()
            visible = torch.cat([torch.ones(Q, K - Q, dtype=torch.bool, device=keys.device), causal], dim=1)
            visible = visible.expand(B, Q, K)
        visible = visible[:, None]
        if self.backend == "sdpa":
            return visible
        return torch.zeros(visible.shape, dtype=dtype, device=keys.device).masked_fill(~visible, torch.finfo(dtype).min)


def _with_mask(module: Any, args: tuple, kwargs: dict[str, Any], mask: torch.Tensor) -> tuple[tuple, dict[str, Any]]:
    """The decoder layer's call with ``attention_mask`` replaced, whether it came by keyword or by position."""
    if "attention_mask" in kwargs:
        return args, {**kwargs, "attention_mask": mask}
    names = [n for n in inspect.signature(module.forward).parameters if n not in ("self", "args", "kwargs")]
    if "attention_mask" in names and names.index("attention_mask") < len(args):
        i = names.index("attention_mask")
        return (*args[:i], mask, *args[i + 1:]), kwargs
    raise UnsupportedError("per-layer masks cannot be applied: the decoder layer takes no attention_mask",
                           found=type(module).__name__, fix="compress only models whose layers take a mask")
