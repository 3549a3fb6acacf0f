"""Watching attention while the model runs, for compression scoring (KV compression).

transformers picks each layer's attention function by name from ``AttentionInterface``.
kvstate registers one more name, ``kvstate_watch``: it runs the family's own eager
attention (so the forward is the eager forward, masks and all) and hands a listener
the layer's post-RoPE queries and attention weights. The name is registered on first
use, never at import, and a model runs with it only inside ``watching``. Decoder-layer
pre-hooks note which layer is running and its RoPE tables (``position_embeddings``),
so a listener can undo the rotation of the queries it sees.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import UnsupportedError
from .core import attention_function

NAME = "kvstate_watch"
# listener(layer, query [B, Hq, q, D], weights [B, Hq, q, K], scaling, rope (cos, sin) [B, q, Dr] or None)
Listener = Callable[[int, torch.Tensor, torch.Tensor, float, Any], None]
_LOCAL = threading.local()  # the listener and the running layer of this thread's watched forward


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, _watched_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])  # eager's additive masks


def _family_eager(module: Any) -> Callable[..., Any]:
    """The eager attention of ``module``'s own modeling file (softcaps, sinks and all), else Llama's."""
    return attention_function(module, "eager")


def _watched_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    out, weights = _family_eager(module)(module, query, key, value, attention_mask, **kwargs)
    listener = getattr(_LOCAL, "listener", None)
    if listener is not None:
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        listener(_LOCAL.layer, query, weights, float(scaling), _LOCAL.rope)
    return out, weights


@contextmanager
def watching(model: Any, listener: Listener) -> Iterator[None]:
    """Run ``model`` with eager attention, calling ``listener`` once per attention layer and forward."""
    from .core import attention_backend, decoder_layers

    _register()

    def note(i: int) -> Any:
        def hook(_module: Any, _args: tuple, kwargs: dict[str, Any]) -> None:
            _LOCAL.layer, _LOCAL.rope = i, kwargs.get("position_embeddings")
        return hook

    handles = [layer.register_forward_pre_hook(note(i), with_kwargs=True)
               for i, layer in enumerate(decoder_layers(model))]
    _LOCAL.listener, _LOCAL.layer, _LOCAL.rope = listener, -1, None
    try:
        with attention_backend(model, NAME, internal=True):
            yield
    finally:
        _LOCAL.listener = None
        for handle in handles:
            handle.remove()


def future_rope(model: Any, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The RoPE tables ``(cos, sin)`` ``[1, F, Dr]`` that ``layer`` would use at ``positions`` ``[1, F]``;
    None for a model without a model-level rotary embedding."""
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None:
        return None
    kwargs: dict[str, Any] = {}
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
        if not layer_types:
            raise UnsupportedError("cannot tell which RoPE table a layer uses", found=type(rotary).__name__,
                                   fix="use a policy that does not need future queries")
        kwargs["layer_type"] = layer_types[layer]
    x = torch.zeros(1, dtype=torch.float32, device=positions.device)
    cos, sin = rotary(x, positions, **kwargs)
    return cos.float(), sin.float()
