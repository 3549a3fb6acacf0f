"""Prepacked CPU matrix kernels for the packed decode's fixed tiles (continuous batching), through torch's private
oneDNN ops ``mkldnn._reorder_linear_weight`` and ``mkldnn._linear_pointwise`` (torch 2.13).

A decode tile is a product of ``rows`` (16) rows by each weight ``[N, K]``. ``F.linear`` picks its
kernel per call and, for so few rows, leaves most of the CPU idle: on the default model's output
layer (262k x 640, fp32, 2 threads) 16 rows took 70 ms against 31 ms for one. oneDNN, given the
weight once in its own blocked layout for that row count, took 51 ms there and 30-60% less on
the body's products; a decode step of 16 streams went from 165 to 137 ms (fp32) and from 89 to
83 ms (bf16). Measured: ``bench/batch_kernels.py``, ``docs/batching.md``.

What the tile contract needs holds as for ``F.linear`` (checked for fp32 and bf16, 1 and 2 threads,
tiles of 2 to 64 rows, the default model's widths; ``tests/test_batch.py`` keeps checking it): with
the row count fixed, a row's result depends neither on its place among the rows nor on the other
rows. More: a kernel prepacked for ``rows`` rows and called on any 2 to 64 rows gave every row the bits
of a whole tile (fp32 and bf16, 1-3 threads; one row differed), so the decode runs fewer rows when fewer
streams run, after probing that per weight (``kvstate.engine.batched.invariant.rows_free``). The bits are not
``F.linear``'s, so a tile of one row (``rows=1``, ``Session``'s decode shape) never uses these kernels.

The packed copy costs about the weight's size again (1.1 GB for the default model in fp32); it is
made on first use, kept while the weight lives, and made again if the weight changes in place.
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
