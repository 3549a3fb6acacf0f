"""One K/V buffer per attention layer for every stream of packed decode steps.

A stream that joins a ``Pool`` has a slot ``s``: layer ``l``'s keys are ``keys[l][s, :, :lengths[s][l]]``
(``[Hkv, n, D]``; values alike). A decode step then writes all streams' new K/V with one ``index_put`` a layer
(``Step.append``) and, where the padding probe holds, attends for all of them in one call (``Step.attend``):
each stream's entry is its grouped decode attention over its slots, padded to a multiple of ``BUCKET`` and
masked to what it sees (a sliding layer: its window). Entries of one call are computed independently; what a
stream's entry shares with the batch is the padded length, so the call is used only where ``attention_free``
measured that further masked padding changes no bit, for the layer's dtype, heads, width, thread count and
kernel (``kvstate._compat.attention.choose``'s pooled path). Elsewhere each stream attends over views of its
slots (``packed``).

The buffers start zeroed (a masked slot must hold a finite value), lengths change only in ``Step.commit``
after the forward (a failed forward leaves every stream as it was), and ``leave`` copies a stream's slots back
into its own cache, which its final state is read from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..._compat import appends
from ..._compat.attention import Path, choose

BUCKET = 64  # a step's padded length is a multiple of this (any SIMD width of the kernels' exp loops)
_FREE: dict[tuple[Any, ...], bool] = {}  # attention_free's verdicts by dtype, heads, width, device and threads


class Pool:
    """The K/V of the streams of packed decode steps (see the module docstring)."""

    def __init__(self, fixed: bool = False) -> None:
        self.fixed = fixed  # every step attends over all S slots and the whole capacity (one shape between growths)
        self.keys: list[torch.Tensor] = []  # per layer [S, Hkv, cap, D]
        self.values: list[torch.Tensor] = []  # per layer [S, Hkv, cap, Dv]
        self.windows: list[int | None] = []  # per layer: a sliding layer's window (None: every slot)
        self.lengths: dict[int, list[int]] = {}  # slot -> per layer, the slots it holds
        self.added: dict[int, int] = {}  # slot -> tokens appended since it joined

    @staticmethod
    def length_class(cache: Any, room: int) -> int:
        """The pool a cache joins with room for ``room`` more tokens: by the slots it needs, 512 or fewer, 513 to
        1,024, ... (so one long stream does not make every slot of its pool as long; its bits do not depend on it)."""
        return max(max(layer.keys.shape[-2] for layer in cache.layers) + room - 1, 511).bit_length()

    @staticmethod
    def poolable(cache: Any) -> bool:
        """Whether every layer of ``cache`` is a filled plain or recording-sliding layer of one sequence."""
        layers = appends.layers(cache)
        return bool(layers) and all(appends.movable(layer) and layer.keys.shape[0] == 1 for layer in layers)

    def join(self, cache: Any, room: int) -> int:
        """Copy a ``poolable`` cache's slots into a free slot with room for ``room`` more tokens; its slot."""
        layers = cache.layers
        lengths = [int(layer.keys.shape[-2]) for layer in layers]
        slot = next(s for s in range(len(self.lengths) + 1) if s not in self.lengths)
        if not self.keys:
            self.windows = [appends.window(layer) for layer in layers]
        self._grow(layers, *self._size(slot + 1, max(lengths) + room))
        for i, layer in enumerate(layers):
            self.keys[i][slot, :, :lengths[i]] = layer.keys[0]
            self.values[i][slot, :, :lengths[i]] = layer.values[0]
        self.lengths[slot], self.added[slot] = lengths, 0
        return slot

    def leave(self, slot: int, cache: Any) -> None:
        """Write the slot's K/V back into ``cache`` (the one it joined with) and free the slot."""
        lengths, added = self.lengths[slot], self.added[slot]
        for i, layer in enumerate(cache.layers):
            keys = self.keys[i][slot, None, :, :lengths[i]].clone(memory_format=torch.contiguous_format)
            values = self.values[i][slot, None, :, :lengths[i]].clone(memory_format=torch.contiguous_format)
            appends.put_back(layer, keys, values, added)
        self.release(slot)

    def release(self, slot: int) -> None:
        """Free the slot (its stream continues from nothing held here); the buffers go with the last one."""
        self.lengths.pop(slot, None)
        self.added.pop(slot, None)
        if not self.lengths:
            self.keys, self.values = [], []

    def step(self, slots: Sequence[int | None]) -> Step:
        """A decode step of one token for each row ``i`` whose ``slots[i]`` is a slot (None: a row whose stream
        keeps its own cache)."""
        step = Step(self, list(slots))
        longest = max(self.lengths[s][i] for s in step.slots for i in range(len(self.keys))) + 1
        if longest > self.keys[0].shape[2]:  # a stream past its room
            self._grow([], *self._size(self.keys[0].shape[0], longest))
        return step

    def _size(self, streams: int, length: int) -> tuple[int, int]:
        """The buffers' slots and length once they hold ``streams`` slots of ``length`` (doubling, so that a batch
        filling up copies each buffer a few times only)."""
        have_s, have_n = (self.keys[0].shape[0], self.keys[0].shape[2]) if self.keys else (0, 0)
        S = have_s if streams <= have_s else max(streams, 2 * have_s)
        n = have_n if length <= have_n else BUCKET * -(-max(length, 2 * have_n) // BUCKET)
        return S, n

    def _grow(self, layers: Sequence[Any], S: int, n: int) -> None:
        """Reallocate the buffers (zero-filled) as ``[S, Hkv, n, D]``, keeping what they hold."""
        if self.keys and (S, n) == (self.keys[0].shape[0], self.keys[0].shape[2]):
            return
        for buffers, own in ((self.keys, list(self.keys) or [layer.keys for layer in layers]),
                             (self.values, list(self.values) or [layer.values for layer in layers])):
            for i, like in enumerate(own):
                grown = like.new_zeros(S, like.shape[1], n, like.shape[3])
                if i < len(buffers):
                    old = buffers[i]
                    grown[:old.shape[0], :, :old.shape[2]] = old
                    buffers[i] = grown
                else:
                    buffers.append(grown)


class Step:
    """One decode step's appends and attention over a ``Pool`` (see the module docstring): ``rows`` are the
    forward's rows whose streams hold slots (``slots``, in the same order); the other rows keep their own caches."""

    def __init__(self, pool: Pool, slots: list[int | None]) -> None:
        self.pool = pool
        self.rows = [i for i, slot in enumerate(slots) if slot is not None]
        self.slots: list[int] = [slots[i] for i in self.rows]  # type: ignore[misc]
        self.of = dict(zip(self.rows, self.slots, strict=True))  # row -> slot
        device = pool.keys[0].device
        self.dense = self.rows == list(range(len(self.rows)))  # pooled rows first: read by narrowing
        self.row_index = torch.tensor(self.rows, dtype=torch.long, device=device)
        self.index = torch.tensor(self.slots, dtype=torch.long, device=device)
        # the batch of a pooled attention call: slots 0 .. span - 1 (fixed: every slot the buffers have)
        self.span = pool.keys[0].shape[0] if pool.fixed else max(self.slots) + 1
        self.identity = self.slots == list(range(self.span))  # rows in slot order: no scatter or gather
        self._groups: dict[tuple[tuple[int, ...], int | None], tuple[torch.Tensor, torch.Tensor, int]] = {}

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write each pooled row's key/value (of ``[1, Hkv, P, D]``) after its slot's in ``layer``."""
        at, _, _ = self._group(layer)
        self.pool.keys[layer][self.index, :, at] = self._mine(keys[0], 1).transpose(0, 1)
        self.pool.values[layer][self.index, :, at] = self._mine(values[0], 1).transpose(0, 1)

    def views(self, layer: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled row ``row``'s visible K/V ``[1, Hkv, k, D]`` in ``layer`` after this step's token (views)."""
        slot, pool = self.of[row], self.pool
        n, window = pool.lengths[slot][layer] + 1, pool.windows[layer]
        start = 0 if window is None else max(0, n - window)
        return (pool.keys[layer][slot, None, :, start:n], pool.values[layer][slot, None, :, start:n])

    def attend(self, layer: int, query: torch.Tensor, scaling: float | None, path: Path | None = None) -> torch.Tensor:
        """The grouped decode attention of the pooled rows in one call on the pooled ``path`` (``kvstate._compat.
        attention.choose``; None: the device's): ``query`` ``[1, H, P, D]`` -> ``[m, H, Dv]`` (row ``rows[j]`` at
        ``j``)."""
        _, mask, L = self._group(layer)
        keys, values = self.pool.keys[layer], self.pool.values[layer]
        heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[3]
        rows = self._mine(query[0], 1).transpose(0, 1).contiguous()  # [m, H, D]
        if not self.identity:
            rows = rows.new_zeros(self.span, heads, dim).index_copy_(0, self.index, rows)
        q = rows.view(-1, kv_heads, heads // kv_heads, dim)
        path = path or _pooled(query.device, query.dtype, dim, heads // kv_heads)
        out = pooled_sdpa(q, keys[:self.span, :, :L], values[:self.span, :, :L], mask, scaling, path)
        # out: [span, Hkv, G, Dv]
        out = out.reshape(self.span, heads, out.shape[-1])
        return out if self.identity else out.index_select(0, self.index)

    def commit(self) -> None:
        """After the forward: every pooled row's stream holds one more slot in every layer."""
        for slot in self.slots:
            lengths = self.pool.lengths[slot]
            for i in range(len(lengths)):
                lengths[i] += 1
            self.pool.added[slot] += 1

    def _mine(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The pooled rows of ``t`` along ``dim`` (a view when they come first)."""
        return t.narrow(dim, 0, len(self.rows)) if self.dense else t.index_select(dim, self.row_index)

    def _group(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """For ``layer``: the write positions ``[m]``, the visibility mask ``[span, 1, 1, L]`` and ``L`` (shared by
        the layers with the same lengths and window)."""
        key = (tuple(self.pool.lengths[s][layer] for s in self.slots), self.pool.windows[layer])
        if key not in self._groups:
            self._groups[key] = self._make(*key)
        return self._groups[key]

    def _make(self, before: tuple[int, ...], window: int | None) -> tuple[torch.Tensor, torch.Tensor, int]:
        device = self.pool.keys[0].device
        after = [0] * self.span
        for slot, n in zip(self.slots, before, strict=True):
            after[slot] = n + 1
        L = self.pool.keys[0].shape[2] if self.pool.fixed else BUCKET * -(-max(after) // BUCKET)
        mask = visible(after, L, window, device)
        mask[torch.tensor(after, device=device) == 0, ..., 0] = True  # a slot no row uses: one finite key, unused
        return torch.tensor(before, device=device), mask, L


def visible(ends: Sequence[int], L: int, window: int | None, device: torch.device | str) -> torch.Tensor:
    """The mask ``[B, 1, 1, L]`` of the slots each of ``B`` rows sees, its slots ending at ``ends[b]``: all before
    that end, or with a sliding ``window`` the last ``window`` of them (as a recording sliding layer returns)."""
    end = torch.tensor(list(ends), device=device)[:, None]
    slot = torch.arange(L, device=device)[None]
    seen = slot < end
    if window is not None:
        seen &= slot >= end - window
    return seen[:, None, None]


def pooled_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scale: float | None, path: Path) -> torch.Tensor:
    """The pooled call, ``[S, Hkv, G, D]`` over ``[S, Hkv, L, D]`` with a boolean ``mask`` ``[S, 1, 1, L]``, on the
    pooled ``path`` ``kvstate._compat.attention.choose`` gave: PyTorch's SDPA with the boolean mask (the CPU), or
    aten's math kernel with the mask made additive (CUDA, where PyTorch's own pick can be cuDNN)."""
    if path.kernel != "math":
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(q, keys, values, additive, scale=scale)[0]


def attention_free(dtype: torch.dtype, kv_heads: int, groups: int, dim: int, device: torch.device,
                   widest: int = 0, path: Path | None = None) -> bool:
    """Whether the grouped SDPA call of one row over its slots, padded to a multiple of ``BUCKET`` and masked,
    gives the row the same bits whatever further masked padding (up to ``widest`` slots, a pool's capacity)
    and other rows share the call: probed once per dtype, heads, width, device, thread count and power of two
    of ``widest`` past 1,600, on seeded random values (lengths across the kernels' vector and block widths,
    windows, batches of 1 and 3). Measured on this project's CPU (``docs/batching.md``)."""
    path = path or _pooled(device, dtype, dim, groups)
    cap = 1600 if widest <= 1600 else 1 << (widest - 1).bit_length()  # room for every padded length probed
    key = (dtype, kv_heads, groups, dim, str(device), torch.get_num_threads(), path, cap)
    if key not in _FREE:
        _FREE[key] = _probe(dtype, kv_heads, groups, dim, device, cap, path)
    return _FREE[key]


def _pooled(device: torch.device, dtype: torch.dtype, dim: int, groups: int) -> Path:
    """The pooled path ``kvstate._compat.attention.choose`` gives where the probe holds."""
    return choose(device.type, dtype, dim, "none", groups=groups, decode="pooled", free=lambda _: True)


def _probe(dtype: torch.dtype, kv_heads: int, groups: int, dim: int, device: torch.device, cap: int,
           path: Path | None = None) -> bool:
    path = path or _pooled(device, dtype, dim, groups)
    generator = torch.Generator().manual_seed(25)
    keys, values = (torch.randn(3, kv_heads, cap, dim, generator=generator).to(dtype=dtype, device=device)
                    for _ in range(2))
    q = torch.randn(3, kv_heads, groups, dim, generator=generator).to(dtype=dtype, device=device)

    with torch.no_grad():
        for n, window in ((1, None), (15, None), (63, None), (64, None), (65, 16), (200, None), (511, None),
                          (512, 100), (513, None), (700, None), (1000, 300)):
            L = BUCKET * -(-n // BUCKET)
            alone = pooled_sdpa(q[:1], keys[:1, :, :L], values[:1, :, :L], visible([n], L, window, device), 0.125,
                                path)
            for wide in (L + BUCKET, BUCKET * -(-(n + 512) // BUCKET), cap):
                ends = [n, max(1, wide - 5), max(1, n // 2)]
                mask = visible(ends, wide, window, device)
                batch = pooled_sdpa(q, keys[:, :, :wide], values[:, :, :wide], mask, 0.125, path)
                if not torch.equal(batch[:1], alone):
                    return False
    return True
