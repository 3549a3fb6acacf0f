"""Where a decode's K/V appends land in a transformers cache layer, for the engine's static room and decode pool.

``DynamicLayer.update`` concatenates, and kvstate's recording sliding layer (``core._RecordingSlidingLayer``)
stores through its ``store``. The engine moves K/V of these two kinds only (``movable``): it redirects their
appends into buffers of its own (``redirect``, undone by ``restore``) or writes a slot's K/V back
(``put_back``). Other layer kinds keep their own appends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .core import _RecordingSlidingLayer

Append = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def layers(cache: Any) -> list[Any]:
    """The layers of a ``DynamicCache`` kvstate built (none for a family's own cache class)."""
    return list(cache.layers) if isinstance(cache, DynamicCache) else []


def movable(layer: Any) -> bool:
    """A filled plain or recording-sliding layer whose keys are ``[B, H, n, D]``."""
    return (type(layer) in (DynamicLayer, _RecordingSlidingLayer) and layer.is_initialized
            and layer.keys is not None and layer.keys.dim() == 4)


def window(layer: Any) -> int | None:
    """The sliding window of a recording sliding layer (None: every slot is visible)."""
    return layer.sliding_window if type(layer) is _RecordingSlidingLayer else None


def redirect(layer: Any, append: Append) -> None:
    """Make a ``movable`` layer store its appends with ``append(keys, values) -> (every key, every value)``; a
    sliding layer keeps its own ``update`` (the visible window) and only stores through ``append``."""
    if type(layer) is _RecordingSlidingLayer:
        layer.store = append
    else:
        layer.update = functools.partial(_plain, layer, append)


def restore(layer: Any) -> None:
    """Undo ``redirect``: the layer appends as its class does."""
    layer.__dict__.pop("store", None)
    layer.__dict__.pop("update", None)


def put_back(layer: Any, keys: torch.Tensor, values: torch.Tensor, appended: int) -> None:
    """Give a ``movable`` layer the K/V ``[1, H, n, D]`` it holds after ``appended`` more tokens were fed."""
    layer.keys, layer.values = keys, values
    if type(layer) is _RecordingSlidingLayer:
        layer.cumulative_length += appended


def _plain(layer: Any, append: Append, keys: torch.Tensor, values: torch.Tensor, *args: Any,
           **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``DynamicLayer.update`` (transformers' own class): every slot."""
    layer.keys, layer.values = append(keys, values)
    return layer.keys, layer.values
