"""kvstate's CUDA attention path run on the CPU, for tests and the device script's CPU trial.

Inside ``cuda_stand_in()`` every model reads as on CUDA to ``kvstate._compat.attention`` (with a faked device
identity, ``GPU``), the kernel rule is CUDA's (float32 may take flash too, so flash's plumbing is exercised in
every dtype), and flash, a CUDA kernel, is stood in by SDPA with the same lower-right causal bias. What it checks
is the plumbing: which kernel each call takes, the mask forms, the kernels label and what reuses it. It says
nothing of the CUDA kernels' bits, which only a GPU run measures.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._compat import attention

GPU = "NVIDIA H100 80GB HBM3|132sm|cuda13.0|torch2.11.0"  # the faked ``attention.identity``


def _flash_on_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  causal: bool) -> torch.Tensor:
    """``attention.flash``'s contract (``[B, H, q, D]``, causal aligned to the last key) on SDPA."""
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(query.shape[2], key.shape[2]) if causal else None
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale,
                                                            enable_gqa=query.shape[1] != key.shape[1])


@contextmanager
def cuda_stand_in(identity: str = GPU) -> Iterator[None]:
    """Run kvstate's CUDA attention path on the CPU inside (module docstring); everything is restored after."""
    rule = attention.choose
    patches: dict[str, Any] = {
        "_device": lambda model: "cuda",
        "identity": lambda model: identity,
        "FLASH_DTYPES": (*attention.FLASH_DTYPES, torch.float32),
        "choose": lambda device, *args, **kwargs: rule("cuda", *args, **kwargs),
        "flash": _flash_on_cpu,
    }
    saved = {name: getattr(attention, name) for name in patches}
    try:
        for name, value in patches.items():
            setattr(attention, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(attention, name, value)
