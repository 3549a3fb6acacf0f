"""The seams of ``model.generate`` kvstate runs through (5.14 through 5.24): its private config helper
``_prepare_generation_config``, its first forward ``_prefill``, the output class that carries the cache
under the model's keyword, and module hooks scoped to one thread and one call."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import ModelOutput

from ..errors import UnsupportedError
from .core import CACHE_KWARG


def own_thread(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as a module hook of the calling thread only: torch runs a module's hooks for every thread's
    forwards, and a plain ``generate`` on the same model in another thread must not see kvstate's."""
    owner = threading.get_ident()

    def scoped(*args: Any, **kwargs: Any) -> Any:
        return hook(*args, **kwargs) if threading.get_ident() == owner else None

    return scoped


@contextmanager
def without_logits(model: Any) -> Iterator[None]:
    """Forwards inside compute no logits: the output head gets zero rows (``[B, 0, V]`` logits).

    For a chunk whose logits nobody reads (the canonical schedule): the head reads all of its ``V x H``
    weights for even one row, and Gemma-3's 262k-token head is 60% of that model. Only a
    ``Linear`` head is trimmed (an ``Embedding`` returned as the head also embeds the input).
    """
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if not isinstance(head, torch.nn.Linear):
        yield
        return
    handle = head.register_forward_pre_hook(own_thread(lambda _module, args: (args[0][..., :0, :], *args[1:])
                                                       if args else None))
    try:
        yield
    finally:
        handle.remove()


def prepare_generation_config(model: Any, generation_config: GenerationConfig | None,
                              kwargs: dict[str, Any]) -> tuple[GenerationConfig, dict[str, Any]]:
    """The config ``model.generate`` would run with, and the kwargs it would hand the model.

    The same private helper ``generate`` calls, so defaults (``model.generation_config``,
    global defaults such as top-k 50) resolve exactly as on the plain path.
    """
    return model._prepare_generation_config(generation_config, **kwargs)


def lm_output(logits: torch.Tensor, cache: Any, name: str = CACHE_KWARG) -> Any:
    """A model output carrying last-position ``logits`` ``[B, 1, V]`` and ``cache`` in the field
    ``name`` (the model's cache keyword: ``generate`` carries the cache on under that name)."""
    return _output_class(name)(logits=logits, **{name: cache})


@functools.cache
def _output_class(name: str) -> type:
    if name in CausalLMOutputWithPast.__dataclass_fields__:
        return CausalLMOutputWithPast
    fields = [("logits", torch.Tensor | None, None), (name, Any, None)]
    return dataclasses.make_dataclass(f"KVStateOutputWith_{name}", fields, bases=(ModelOutput,))


@contextmanager
def replaced_prefill(model: Any, prefill: Callable[[], CausalLMOutputWithPast]) -> Iterator[None]:
    """Run ``model.generate`` with its first forward (``_prefill``) replaced by ``prefill()``.

    ``generate`` then does everything else itself (logits processors, stopping criteria,
    streamers, sampling, outputs) over the full history it was given. Scoped to one
    call: the instance attribute is removed in ``finally``.
    """
    if not callable(getattr(type(model), "_prefill", None)):
        raise UnsupportedError("this transformers version has no GenerationMixin._prefill",
                               found=type(model).__name__, fix="install a transformers version kvstate supports")
    model._prefill = lambda *args, **kwargs: prefill()
    try:
        yield
    finally:
        del model._prefill
