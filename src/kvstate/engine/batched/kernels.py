"""Prepacked CPU matrix kernels for the packed forwards' fixed tiles (oneDNN, through ``kvstate._compat.onednn``).

A tile is a product of ``rows`` rows by each weight ``[N, K]``. ``F.linear`` picks its kernel per call and
leaves most of the CPU idle for so few rows; oneDNN, given the weight once in its blocked layout for that
row count, is faster (``docs/benchmarks.md``). The tile contract holds as for ``F.linear``: with the row count
fixed, a row's result depends neither on its place nor on the other rows (``tests/test_batch_tiles.py``). A kernel
prepacked for ``rows`` rows and called on fewer rows gave each its tile's bits on this project's CPU, which
``invariant.rows_free`` probes per weight before relying on it. The bits are not ``F.linear``'s, so a one-row
tile (``Session``'s decode) never uses these kernels. The packed copy costs about the weight's size again; it
is made on first use, kept while the weight lives, and made again if the weight changes in place.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..._compat.onednn import available, linear, reorder

Kernel = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]

_DTYPES = (torch.float32, torch.bfloat16)
# id(weight) -> (a weak reference to it, {rows: (weight._version when packed, packed weight)}), dropped with the
# weight (a WeakKeyDictionary would compare tensors with ``==`` on a hash collision)
_PACKED: dict[int, tuple[weakref.ref, dict[int, tuple[int, torch.Tensor]]]] = {}


def _held(weight: torch.Tensor) -> dict[int, tuple[int, torch.Tensor]]:
    key = id(weight)
    entry = _PACKED.get(key)
    if entry is None or entry[0]() is not weight:
        entry = _PACKED[key] = (weakref.ref(weight, lambda _ref: _PACKED.pop(key, None)), {})
    return entry[1]


__all__ = ["Kernel", "available", "tile_kernel"]


def _reorder(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` ``[N, K]`` prepacked for products of ``rows`` rows (a copy; ``kvstate._compat.onednn``)."""
    return reorder(weight, rows)


def tile_kernel(weight: torch.Tensor, rows: int) -> Kernel | None:
    """The product ``kernel(x, bias)`` of ``x`` ``[rows, K]`` by ``weight`` ``[N, K]`` (``F.linear``'s
    layout) -> ``[rows, N]``, on ``weight`` prepacked for ``rows`` rows; None where none applies (one
    row, not a CPU fp32 / bf16 2-D weight, no oneDNN): the caller then uses ``F.linear``."""
    if rows < 2 or weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype not in _DTYPES \
            or weight.is_meta or not available():
        return None
    held = _held(weight)
    version = weight._version
    entry = held.get(rows)
    if entry is None or entry[0] != version:
        entry = held[rows] = (version, _reorder(weight, rows))
    packed = entry[1]

    def kernel(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, packed, bias)

    return kernel
