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

A layer whose KV heads hold their own slots (``per_head``) gets a mask per query head,
``[B, Hq, Q, K]``: query head ``h`` reads KV head ``h // (Hq / H)``, as transformers' ``repeat_kv``
(and 5.25's single-query ``pack_gqa``) pair them, and padding slots are never visible. Other
layers get ``[B, 1, Q, K]``, shared by every head.

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
from .layers import PAD, LayerState, attention_of

_BACKENDS = ("sdpa", "eager")


def needs_masks(layers: tuple[LayerState, ...]) -> bool:
    return any(part is not None and part.compressed for part in map(attention_of, layers))


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
    plan = _Plan(layers, queries, backend, _query_heads(model))
    handles = []
    try:
        for i, decoder_layer in enumerate(decoder_layers(model)):
            if attention_of(layers[i]) is not None:
                handles.append(decoder_layer.register_forward_pre_hook(own_thread(plan.layer_hook(i)),
                                                                       with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _query_heads(model: Any) -> int:
    """Query heads of the model's attention layers (``Hq``), for per-head masks."""
    return int(model.config.get_text_config(decoder=True).num_attention_heads)


class _Plan:
    """Key positions per layer (``[B, K(, R)]``, or ``[B, H, K(, R)]`` per head), extended forward by forward."""

    def __init__(self, layers: tuple[LayerState, ...], queries: Any, backend: str, q_heads: int) -> None:
        parts = {i: attention_of(layer) for i, layer in enumerate(layers)}
        attention = {i: part for i, part in parts.items() if part is not None}
        self.keys = {i: layer.positions for i, layer in attention.items()}
        self.windows = {i: layer.window for i, layer in attention.items()}
        self.per_head = {i: layer.per_head for i, layer in attention.items()}
        self.queries = queries
        self.backend = backend
        self.q_heads = q_heads

    def layer_hook(self, i: int) -> Any:
        def hook(module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
            query = self.queries.current
            old, window = self.keys[i], self.windows[i]
            if self.per_head[i]:
                assert old is not None
                keys = torch.cat([old, query[:, None].expand(-1, old.shape[1], *query.shape[1:])], dim=2)
            else:
                keys = query if old is None else torch.cat([old, query], dim=1)
            self.keys[i] = keys
            if window is not None:  # transformers' sliding layers hand attention only the last W - 1 + Q slots
                cut = -(window - 1 + query.shape[1])
                keys = keys[:, :, cut:] if self.per_head[i] else keys[:, cut:]
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            visible = self._heads(keys, query, window) if self.per_head[i] else self._shared(keys, query, window)
            return with_mask(module, args, kwargs, self._form(visible, hidden.dtype))

        return hook

    def _shared(self, keys: torch.Tensor, queries: torch.Tensor, window: int | None) -> torch.Tensor:
        """``[B, 1, Q, K]``: which stored or new slots each query may attend to."""
        if keys.dim() == 2:
            visible = keys[:, None, :] <= queries[:, :, None]
            if window is not None:
                visible &= queries[:, :, None] - keys[:, None, :] < window
        else:  # M-RoPE positions are not ordered: retained slots all visible, new ones causal by index
            visible = _multimodal(keys.shape[0], keys.shape[1], queries.shape[1], keys.device)
        return visible[:, None]

    def _heads(self, keys: torch.Tensor, queries: torch.Tensor, window: int | None) -> torch.Tensor:
        """``[B, Hq, Q, K]`` from per-head key positions ``[B, H, K(, R)]``: each KV head's mask, repeated for
        the query heads that read it; padding slots are hidden."""
        B, H, K = keys.shape[:3]
        Q = queries.shape[1]
        if self.q_heads % H:
            raise UnsupportedError("per-head masks need query heads in groups of KV heads",
                                   expected=f"a multiple of {H} query heads", found=self.q_heads,
                                   fix="compress with a policy that keeps the same slots in every head")
        if keys.dim() == 3:
            visible = keys[:, :, None, :] <= queries[:, None, :, None]
            if window is not None:
                visible &= queries[:, None, :, None] - keys[:, :, None, :] < window
            valid = keys != PAD
        else:
            visible = _multimodal(B, K, Q, keys.device)[:, None].expand(B, H, Q, K)
            valid = keys[..., 0] != PAD
        visible = visible & valid[:, :, None, :]
        return visible.repeat_interleave(self.q_heads // H, dim=1)

    def _form(self, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The mask as the backend takes it: boolean for sdpa, additive for eager."""
        if self.backend == "sdpa":
            return visible
        return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible,
                                                                                          torch.finfo(dtype).min)


def _multimodal(B: int, K: int, Q: int, device: torch.device) -> torch.Tensor:
    """``[B, Q, K]``: every retained slot, and the ``Q`` new ones causally by index."""
    causal = torch.ones(Q, Q, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(Q, K - Q, dtype=torch.bool, device=device), causal], dim=1).expand(B, Q, K)


def with_mask(module: Any, args: tuple, kwargs: dict[str, Any], mask: torch.Tensor) -> tuple[tuple, dict[str, Any]]:
    """The decoder layer's call with ``attention_mask`` replaced, whether it came by keyword or by position."""
    if "attention_mask" in kwargs:
        return args, {**kwargs, "attention_mask": mask}
    names = [n for n in inspect.signature(module.forward).parameters if n not in ("self", "args", "kwargs")]
    if "attention_mask" in names and names.index("attention_mask") < len(args):
        i = names.index("attention_mask")
        return (*args[:i], mask, *args[i + 1:]), kwargs
    raise UnsupportedError("per-layer masks cannot be applied: the decoder layer takes no attention_mask",
                           found=type(module).__name__, fix="compress only models whose layers take a mask")
