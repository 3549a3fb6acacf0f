"""A packed forward: the rows of several conversations in one forward of batch 1, each seeing only its own K/V.

Conversation ``i``'s rows are a segment ``[start_i, start_i + n_i)`` of one sequence ``[1, P]`` (rows after the
last segment are padding), each with its own ``position_ids``: its next token (a decode step) or a prefill
chunk. Two transformers seams keep the conversations apart, and nothing is patched:

* the cache is a ``PackedCache``: ``update`` hands each conversation's K/V rows ``[1, Hkv, n_i, D]`` to its own
  ``DynamicCache`` (or, for decode rows of a ``pool.Pool``, writes them into the pool) and keeps what each
  returns;
* the attention function ``kvstate_packed`` (registered on first use) runs each conversation's attention over
  its own K/V with the shapes it has alone: one decode row with no mask, a chunk with a causal (and sliding)
  mask built from the segment alone (``segment_mask``). Which call a decode row makes, the model's own, the
  grouped form or a pool's one pooled call, is ``kvstate._compat.attention.choose``'s decision.

A model that does not fit (it asks the cache for one sequence length, attends with K/V other than its cache
returned, as MLA does) raises ``Unpackable`` during the forward.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ..._compat import attention
from ..._compat.attention import Path
from ..._compat.core import attention_backend, attention_function, attention_implementation, register_attention
from ...errors import UnsupportedError
from .pool import Step, attention_free

NAME = "kvstate_packed"
_LOCAL = threading.local()  # the PackedCache of this thread's packed forward


class Unpackable(UnsupportedError):
    """The model's forward needs something a packed forward cannot give (one sequence length, attention
    outside ``AttentionInterface`` or over K/V its cache did not return, a matrix product the tiles
    cannot split); its conversations decode one per forward instead."""


class PackedCache:
    """The cache of a packed forward: ``caches[i]`` is conversation ``i``'s ``DynamicCache``, fed rows
    ``segments[i]`` (``(start, n)``; by default row ``i`` alone, a decode step) of the packed sequence;
    rows outside every segment are padding and stored nowhere. ``windows``: each layer's sliding window
    (None: full attention), for the masks of chunks of more than one row."""

    def __init__(self, caches: Sequence[Any], verify: bool = True,
                 segments: Sequence[tuple[int, int]] | None = None, windows: Sequence[int | None] = (),
                 grouped: bool = False, steps: Sequence[Step] = ()) -> None:
        self.caches = list(caches)
        self.steps = list(steps)  # decode steps over pools (kvstate.engine.batched.pool): their rows skip ``caches``
        self.owner = {row: step for step in self.steps for row in step.rows}
        self.grouped = grouped  # decode rows in reduced precision attend in the grouped form (module docstring)
        self.segments = [(i, 1) for i in range(len(self.caches))] if segments is None else list(segments)
        self.windows = list(windows)
        self.verify = verify  # check that each layer attends with the K/V its cache returned
        self.seen: dict[int, list[tuple[torch.Tensor, torch.Tensor] | None]] = {}  # None: a pooled row
        self.attended: set[int] = set()  # layers whose attention ran through kvstate_packed

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [1, Hkv, P, D]; the rows of segment i belong to conversation i
        for step in self.steps:
            step.append(layer_idx, key_states, value_states)
        self.seen[layer_idx] = [
            None if i in self.owner else
            cache.update(key_states.narrow(2, s, n).contiguous(), value_states.narrow(2, s, n).contiguous(), layer_idx)
            for i, ((s, n), cache) in enumerate(zip(self.segments, self.caches, strict=True))]
        return key_states, value_states

    def pairs(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each segment's visible K/V ``[1, Hkv, k, D]`` in ``layer`` (a pooled row's: views of its slots)."""
        return [kv if kv is not None else self.owner[i].views(layer, i) for i, kv in enumerate(self.seen[layer])]

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if layer < len(self.windows) else None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # the conversations have different lengths: a model that asks for one cannot be packed
        raise Unpackable("a packed forward has no single sequence length", found="the model asked for one",
                         fix="decode one conversation per forward")


@functools.cache
def _register() -> None:
    register_attention(NAME, _packed_attention)


def _packed_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``query`` ``[1, H, P, D]``: segment ``i`` attends over conversation ``i``'s own K/V; padding rows give 0."""
    cache: PackedCache = _LOCAL.cache
    layer = getattr(module, "layer_idx", None)
    if layer not in cache.seen:  # K/V that did not come through this forward's cache update (shared layers)
        raise Unpackable("an attention layer attends to K/V its cache update did not return", found=layer,
                         fix="decode one conversation per forward")
    attend = attention_function(module, _LOCAL.backend)
    pooled_path = _path(query, key, kwargs, "pooled", cache.steps) if cache.grouped and cache.steps else None
    steps = cache.steps if pooled_path is not None and pooled_path.form == "pooled" else []
    group = cache.grouped and _path(query, key, kwargs, "row").form == "grouped"
    one = len(steps) == 1 and len(steps[0].rows) == len(cache.segments)  # every row in one pooled call
    pairs = cache.pairs(layer) if cache.verify or not one else None
    if cache.verify:  # before any attention: a model attending with other K/V than its cache's is refused
        for (s, n), (k, v) in zip(cache.segments, pairs, strict=True):  # type: ignore[arg-type]
            _check_same(key, k, s, n)
            _check_same(value, v, s, n)
    outs: dict[int, torch.Tensor] = {}  # segment -> [1, n, H, Dv]
    _LOCAL.attending = True
    try:
        for step in steps:  # each pool's rows in one call (kvstate.engine.batched.pool)
            pooled = step.attend(layer, query, kwargs.get("scaling"), pooled_path)  # [m, H, Dv]
            outs.update((row, pooled[None, j:j + 1]) for j, row in enumerate(step.rows))
    finally:
        _LOCAL.attending = False
    whole = pooled[None] if pairs is None else \
        torch.cat(_each(module, attend, query, cache, layer, pairs, outs, group, kwargs), dim=1)
    P, used = query.shape[2], sum(n for _, n in cache.segments)
    if used < P:
        whole = torch.cat([whole, whole.new_zeros(1, P - used, *whole.shape[2:])], dim=1)
    cache.attended.add(layer)
    return whole, None


def _each(module: Any, attend: Callable[..., Any], query: torch.Tensor, cache: PackedCache, layer: int,
          pairs: list[tuple[torch.Tensor, torch.Tensor]], outs: dict[int, torch.Tensor], group: bool,
          kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Each segment's attention ``[1, n, H, Dv]`` over its own K/V (``outs``: those already computed)."""
    # grouped decode rows read their query heads from one transposed copy [1, P, H, D] (no copy per stream)
    rows = query.transpose(1, 2).contiguous() if group else None
    _LOCAL.attending = True
    try:
        for i, ((s, n), (k, v)) in enumerate(zip(cache.segments, pairs, strict=True)):
            if i in outs:
                continue
            if rows is not None and n == 1:
                outs[i], _ = _grouped(module, rows[:, s], k, v, None, **kwargs)
            else:
                mask = None if n == 1 else segment_mask(n, k.shape[2], cache.window(layer), query.dtype, query.device)
                outs[i], _ = attend(module, query[:, :, s:s + n].contiguous(), k, v, mask, **kwargs)
    finally:
        _LOCAL.attending = False
    return [outs[i] for i in range(len(pairs))]


def _path(query: torch.Tensor, key: torch.Tensor, kwargs: dict[str, Any], decode: str,
          steps: Sequence[Step] = ()) -> Path:
    """``kvstate._compat.attention.choose`` for this layer's decode rows (``decode``: ``pooled`` for the rows of
    ``steps``' pools, whose padding probe ``_pool_free`` measures; ``row`` for one row with its own cache)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    groups = heads // kv_heads if heads % kv_heads == 0 and query.shape[3] == key.shape[3] else 0
    extras = bool(kwargs.get("dropout")) or bool(kwargs.get("output_attentions")) or \
        any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks"))
    return attention.choose(query.device.type, query.dtype, query.shape[3], "none", extras, backend=_LOCAL.backend,
                            groups=groups, decode=decode,
                            free=lambda candidate: _pool_free(candidate, query, kv_heads, groups, steps))


def _pool_free(path: Path, query: torch.Tensor, kv_heads: int, groups: int, steps: Sequence[Step]) -> bool:
    """The pools' padding probe (``kvstate.engine.batched.pool.attention_free``) for the pooled ``path``, up to
    their largest capacity."""
    return attention_free(query.dtype, kv_heads, groups, query.shape[3], query.device,
                          max(step.pool.keys[0].shape[2] for step in steps), path)


def _grouped(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: None, scaling: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA of one decode row's query heads ``[1, H, D]`` (contiguous) over K/V ``[1, Hkv, T, D]``, the
    ``G = H / Hkv`` query heads of each K/V head as ``G`` rows of one query (head ``h`` attends with K/V head
    ``h // G``, as ``enable_gqa`` and ``repeat_kv`` map them); ``[1, 1, H, Dv]``, as transformers' sdpa
    function returns."""
    heads, dim, kv_heads = query.shape[1], query.shape[2], key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(query.view(1, kv_heads, heads // kv_heads, dim),
                                                           key, value, scale=scaling)  # [1, Hkv, G, Dv]
    return out.reshape(1, 1, heads, out.shape[-1]), None


def segment_mask(n: int, keys: int, window: int | None, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The additive mask ``[1, 1, n, keys]`` of ``n`` new rows over the ``keys`` K/V their cache returned (the
    last ``n`` are theirs): a row sees the keys up to itself, and with a sliding ``window`` only the last
    ``window`` of those (transformers' convention: query ``q`` sees key ``k`` when ``q - window < k <= q``)."""
    q = torch.arange(keys - n, keys, device=device)[:, None]
    k = torch.arange(keys, device=device)[None]
    visible = k <= q
    if window is not None:
        visible &= k > q - window
    mask = torch.zeros(n, keys, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def _check_same(packed_rows: torch.Tensor, own: torch.Tensor, start: int, n: int) -> None:
    """Rows ``[start, start + n)`` of the K (or V) the model attends with ``[1, Hkv, P, D]`` are the newest
    slots of their stream's cache ``[1, Hkv, S, D]``; a model that transforms what its cache returns (MLA's
    latents) cannot be packed."""
    same = packed_rows.shape[1] == own.shape[1] and packed_rows.shape[3] == own.shape[3] and own.shape[2] >= n
    if not same or not torch.equal(packed_rows[:, :, start:start + n], own[:, :, own.shape[2] - n:]):
        raise Unpackable("the model attends with K/V other than its cache returns", found=tuple(own.shape),
                         fix="decode one conversation per forward")


def attending() -> bool:
    """Whether this thread is inside the per-stream attention of a packed forward (its products are the
    stream's alone, not the packed rows')."""
    return bool(getattr(_LOCAL, "attending", False))


@contextmanager
def packed(model: Any, cache: PackedCache) -> Iterator[None]:
    """Run ``model``'s forwards inside as packed forwards over ``cache`` (see the module docstring)."""
    _register()
    backend = attention_implementation(model)
    _LOCAL.cache, _LOCAL.backend = cache, backend
    try:
        with attention_backend(model, NAME, internal=True):
            yield
    finally:
        _LOCAL.cache = None
