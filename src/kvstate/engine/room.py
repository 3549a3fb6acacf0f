"""Room to grow: a packed decode appends each step's slot in place (continuous batching), for a cache that
``kvstate.engine.batched.pool`` cannot hold (and for one-row tiles, whose decode stays ``Session``'s).

transformers' ``DynamicLayer.update`` concatenates, so every decode step copies each layer's whole
K/V. Measured here for 16 streams x 18 layers of the default model (K and V, one slot each): 30 ms
a step at 350 slots, 145 ms at 1,000, 323 ms at 2,000, where the step's matrix products take
about 120 ms. ``reserve`` gives a cache's plain and recording-sliding layers room for more slots:
their appends then write into the room, and the layer's keys and values are views of it. The
values are the same; a layer with several K/V heads now attends over a strided view, as a sliding
layer's window always did (``tests/test_batch.py`` checks one-row tiles against ``Session``'s
decode on such layers). ``compact`` copies each view out once when the stream ends, so no state
keeps the unused room alive. Other layer kinds keep concatenating.
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
