"""torch's private oneDNN linear ops (``torch.ops.mkldnn``, torch 2.13): a weight reordered once for a row count,
then products on it. The engine's tile kernels (``kvstate.engine.batched.kernels``) are built on these."""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    """Whether this torch has the oneDNN linear ops (a CPU build with mkldnn)."""
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def reorder(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` ``[N, K]`` in oneDNN's blocked layout for products of ``rows`` rows (a copy)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[M, K]`` times a ``reorder`` ed weight, plus ``bias``: ``[M, N]``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
