"""Room to grow: a decode appends each step's K/V in place instead of concatenating (``Session``'s decode, and
a packed decode's caches that ``kvstate.engine.batched.pool`` does not hold).

transformers' ``DynamicLayer.update`` concatenates, so every decode step copies each layer's whole K/V, a
cost that grows with the history (``docs/benchmarks.md``). ``reserve`` gives a cache's plain and recording
sliding layers room for the answer's slots (``kvstate._compat.appends``): their appends write into it, and the
layer's keys and values are views of it, the same values (a layer with several K/V heads attends over a
strided view, as a sliding window always did). ``compact`` copies each view out once when the decode ends,
so no state keeps the unused room alive. Other layer kinds keep concatenating.
"""

from __future__ import annotations

from typing import Any

import torch

from .._compat import appends


class _Room:
    """One layer's keys and values ``[B, H, n, D]``, in buffers with room for more slots. The room is made by the
    first append (``extra`` slots, so a call that appends nothing copies nothing) and doubled when full."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, extra: int) -> None:
        self.n, self.extra, self.grown = keys.shape[-2], extra, False
        self.keys, self.values = keys, values

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys``/``values`` ``[B, H, q, D]`` after the slots so far; every slot, as views."""
        n, q = self.n, keys.shape[-2]
        if n + q > self.keys.shape[-2]:
            room, self.extra, self.grown = max(q, self.extra or n), 0, True
            self.keys = _with_room(self.keys[..., :n, :], room)
            self.values = _with_room(self.values[..., :n, :], room)
        self.keys.narrow(-2, n, q).copy_(keys)  # narrow, not indexing: this runs per stream, layer and step
        self.values.narrow(-2, n, q).copy_(values)
        self.n = n + q
        return self.keys.narrow(-2, 0, self.n), self.values.narrow(-2, 0, self.n)


def _with_room(t: torch.Tensor, extra: int) -> torch.Tensor:
    out = t.new_empty(*t.shape[:-2], t.shape[-2] + extra, t.shape[-1])
    out[..., :t.shape[-2], :] = t
    return out


def reserve(cache: Any, extra: int) -> None:
    """Give each filled plain or recording-sliding layer of ``cache`` (a ``DynamicCache`` kvstate built) room
    for ``extra`` more slots: its appends then write in place (the layer objects are this cache's own). A
    sliding layer keeps its own ``update`` (the visible window) and only stores into the room. Caches of other
    classes (a family's own, RWKV's state list) keep their appends (``kvstate._compat.appends``)."""
    for layer in appends.layers(cache):
        if appends.movable(layer):
            layer.room = _Room(layer.keys, layer.values, extra)
            appends.redirect(layer, layer.room.append)


def compact(cache: Any) -> None:
    """Copy the slots of each layer that grew into its room out of it (contiguous, as concatenation leaves them),
    so no state keeps the room alive, and end the growth; a layer that appended nothing is left as it was."""
    for layer in appends.layers(cache):
        room = layer.__dict__.pop("room", None)
        appends.restore(layer)
        if room is not None and room.grown:
            layer.keys = layer.keys.clone(memory_format=torch.contiguous_format)
            layer.values = layer.values.clone(memory_format=torch.contiguous_format)
