"""Watching attention while the model runs, for compression scoring (KV compression).

transformers picks each layer's attention function by name from ``AttentionInterface``.
kvstate registers one more name, ``kvstate_watch``: it runs the family's own eager
attention (so the forward is the eager forward, masks and all) and hands a listener
the layer's post-RoPE queries, keys, values and attention weights; with ``weights=False``
it runs the model's own attention function instead (sdpa; kvstate's deterministic path on
CUDA) and hands out no weights, for scores computed from queries and keys alone. The name
is registered on first use, never at import, and a model runs with it only inside
``watching``. Decoder-layer pre-hooks note which layer is running and its RoPE tables
(``position_embeddings``), so a listener can undo the rotation of the queries it sees; with
``norms=True`` a pre-hook on each layer's ``self_attn`` notes the norm of its input (KVzip+).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import UnsupportedError
from .attention import WATCH, _function
from .core import attention_function

NAME = WATCH
_LOCAL = threading.local()  # the listener and the running layer of this thread's watched forward


@dataclass(frozen=True)
class Watched:
    """One attention call of a watched forward."""

    layer: int
    query: torch.Tensor  # [B, Hq, q, D], post-RoPE
    key: torch.Tensor  # [B, H, K, D]: every key the call attends over, the fed tokens' last
    value: torch.Tensor  # [B, H, K, Dv]
    weights: torch.Tensor | None  # [B, Hq, q, K] (eager), or None with weights=False
    scaling: float
    rope: Any  # (cos, sin) [B, q, Dr] the queries were rotated with, or None
    hidden_norm: torch.Tensor | None = None  # [B, q]: norm of the attention's input (norms=True)
    out_proj: torch.Tensor | None = None  # the output projection's weight [hidden, Hq * Dv] (norms=True)


Listener = Callable[[Watched], None]


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
                       attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    inner = getattr(_LOCAL, "inner", None)
    listener = getattr(_LOCAL, "listener", None)
    attend = getattr(listener, "attend", None) if inner is not None and plain_softmax(module) else None
    if listener is not None:
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        norms = getattr(_LOCAL, "norms", None)
        projection = getattr(getattr(module, "o_proj", None), "weight", None) if norms is not None else None
        watched = Watched(_LOCAL.layer, query, key, value, None, float(scaling), _LOCAL.rope,
                          None if norms is None else norms.get(_LOCAL.layer), projection)
        if attend is not None and kwargs.get("sliding_window") is None and not kwargs.get("dropout"):
            out = attend(watched)  # the listener's own softmax is the layer's: it gives the output too
            if out is not None:
                return out, None
    function = _family_eager(module) if inner is None else _inner_function(module, inner, query.device.type)
    out, weights = function(module, query, key, value, attention_mask, **kwargs)
    if listener is not None:
        listener(watched if inner is not None else replace(watched, weights=weights))
    return out, weights


_PLAIN: dict[type, bool] = {}


def plain_softmax(module: Any) -> bool:
    """Whether ``module``'s family attends as Llama does, ``softmax(q k^T * scaling + mask) v`` and nothing else
    (no softcap, no sinks): its eager function is Llama's, instruction for instruction."""
    if type(module) not in _PLAIN:
        from transformers.models.llama.modeling_llama import eager_attention_forward

        mine, llama = _family_eager(module).__code__, eager_attention_forward.__code__
        _PLAIN[type(module)] = (mine.co_code, mine.co_consts, mine.co_names) == (
            llama.co_code, llama.co_consts, llama.co_names)
    return _PLAIN[type(module)]


def _inner_function(module: Any, name: str, device: str) -> Callable[..., Any]:
    """The attention function ``name`` runs under kvstate (sdpa: the deterministic path on CUDA)."""
    return _function(module, name, device)


@contextmanager
def watching(model: Any, listener: Listener, weights: bool = True, norms: bool = False) -> Iterator[None]:
    """Run ``model`` with watched attention, calling ``listener`` once per attention layer and forward:
    eager attention with its weights, or (``weights=False``) the model's own attention without them."""
    from .core import attention_backend, attention_implementation, decoder_layers

    _register()
    inner = None if weights else attention_implementation(model)

    def note(i: int) -> Any:
        def hook(_module: Any, _args: tuple, kwargs: dict[str, Any]) -> None:
            _LOCAL.layer, _LOCAL.rope = i, kwargs.get("position_embeddings")
        return hook

    def norm(i: int) -> Any:
        def hook(_module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            _LOCAL.norms[i] = hidden.float().norm(dim=-1)
        return hook

    layers = decoder_layers(model)
    handles = [layer.register_forward_pre_hook(note(i), with_kwargs=True) for i, layer in enumerate(layers)]
    if norms:
        handles += [attention.register_forward_pre_hook(norm(i), with_kwargs=True)
                    for i, attention in enumerate(attention_modules(model)) if attention is not None]
    _LOCAL.listener, _LOCAL.layer, _LOCAL.rope, _LOCAL.inner = listener, -1, None, inner
    _LOCAL.norms = {} if norms else None
    try:
        with attention_backend(model, NAME, internal=True):
            yield
    finally:
        _LOCAL.listener, _LOCAL.inner, _LOCAL.norms = None, None, None
        for handle in handles:
            handle.remove()


def attention_modules(model: Any) -> list[Any]:
    """Each decoder layer's self-attention module (None where the layer has none by that name)."""
    from .core import decoder_layers

    return [getattr(layer, "self_attn", None) for layer in decoder_layers(model)]


def out_projections(model: Any, layers: list[int]) -> bool:
    """Whether each of ``layers`` has a self-attention module with a readable ``o_proj`` weight (KVzip+)."""
    if not layers:
        return True
    modules = attention_modules(model)
    return all(i < len(modules) and isinstance(getattr(getattr(modules[i], "o_proj", None), "weight", None),
                                                 torch.Tensor) for i in layers)


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
