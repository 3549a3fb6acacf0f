"""Tensor checksums of state files, and kvstate's one background I/O thread (hostile inputs).

``xxhash`` releases the GIL, so a save hashes its tensors on that thread while the calling
one writes them, and the blocks of a file a save replaced are freed there too; see
``container.write``.
"""

from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xxhash

from ..errors import StateFileError

CHECKSUMS = ("xxh3-64", "crc32")  # by format version: 2, 1


class _Crc32:
    """CRC-32 with the streaming interface of ``xxhash`` (format version 1)."""

    def __init__(self, seed: str) -> None:
        self.value = zlib.crc32(seed.encode())

    def update(self, data: memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value & 0xFFFFFFFF:08x}"


def new_hasher(algorithm: str, seed: str) -> xxhash.xxh3_64 | _Crc32:
    """A streaming hasher of ``algorithm`` seeded with ``seed`` (a tensor's dtype and shape)."""
    if algorithm == "crc32":
        return _Crc32(seed)
    if algorithm == "xxh3-64":
        return xxhash.xxh3_64(seed=zlib.crc32(seed.encode()))
    raise StateFileError("unknown checksum algorithm", expected=CHECKSUMS, found=algorithm, fix="upgrade kvstate")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` (copied to contiguous CPU memory if needed)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstate-hash")
        return _POOL


def _forget_pool() -> None:
    """A forked child has no worker thread: start a new pool there on first use."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def run_beside(task: Any, *args: Any) -> Future[Any]:
    """Run ``task(*args)`` on kvstate's one background I/O thread (its GIL-free work overlaps ours)."""
    return _pool().submit(task, *args)
