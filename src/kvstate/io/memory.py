"""Memory for loads: refuse what cannot fit, and map what will fit cheaply (hostile inputs)."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ..errors import StateFileError


def check_memory(data_size: int, path: Path) -> None:
    """Refuse a file whose data could never fit in memory before allocating for it."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if data_size > physical:
        raise StateFileError("state file larger than this machine's memory", expected=f"<= {physical} bytes",
                             found=f"{data_size} bytes of tensors in {path}", fix="load it on a larger machine")


_HUGE_PAGE = 2**21


def prefer_huge_pages(data: torch.Tensor) -> None:
    """Ask Linux to back ``data`` with 2 MiB pages (``MADV_HUGEPAGE``), where transparent huge pages are
    on "madvise". When malloc hands a large load fresh memory, faulting it in 4 KiB pages costs more
    than the read itself (docs/benchmarks.md; memory malloc reuses is already mapped and is unaffected).
    Advice only: any failure leaves the read as it was."""
    libc = _libc()
    start = -(-data.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (data.data_ptr() + data.numel()) // _HUGE_PAGE * _HUGE_PAGE
    if libc is not None and end > start:
        libc.madvise(start, end - start, 14)  # MADV_HUGEPAGE


@functools.cache
def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None
