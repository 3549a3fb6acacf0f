"""Batch-invariant linear layers: every matrix product runs on tiles of exactly ``rows`` rows (issue 25).

A CPU or GPU matrix kernel is chosen by the number of rows: measured on this project's CPU
(``docs/batching.md``), a row of ``F.linear`` over ``M`` rows differs from the same row over
``M'`` rows for most ``M != M'`` (fp32 and bf16, 1 and 2 threads). For a *fixed* row count the
result of a row did not depend on its place among the rows, on the other rows' contents, or on
zero padding. So inside ``tiled_linear(rows)`` each ``F.linear`` pads its input to a multiple of
``rows`` and runs one product per tile of ``rows`` rows: a row's bits are those of the tile
kernel, whoever shares its forward.

The mode is a ``torch.overrides.TorchFunctionMode``: it applies to the calling thread only, and only
inside the ``with`` block (nothing is patched).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed in tiles of ``rows`` rows (``x`` ``[..., K]``, zero-padded)."""
    K = x.shape[-1]
    flat = x.reshape(-1, K)
    M = flat.shape[0]
    pad = -M % rows
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, K)])
    out = torch.cat([F.linear(flat[i:i + rows], weight, bias) for i in range(0, M + pad, rows)])
    return out[:M].reshape(*x.shape[:-1], out.shape[-1])


class _TiledLinear(TorchFunctionMode):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:  # the mode is off inside this call, so the tiles run the plain kernel
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            return tiled(x, weight, bias, self.rows)
        return func(*args, **kwargs)


@contextmanager
def tiled_linear(rows: int) -> Iterator[None]:
    """Inside, every ``F.linear`` (``nn.Linear`` included) on this thread runs in tiles of ``rows`` rows."""
    with _TiledLinear(rows):
        yield
