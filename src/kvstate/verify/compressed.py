"""The compression rows: ratio 0 is the identity, and a real compression continues as its masks say.

``compression_rows`` checks, on the matrix's prefix:

* identity: ``compress(KNorm(0.0))`` then resume, bitwise the uncompressed continuation;
* per head: ``compress(KVzip(0.5))`` (every KV head keeps its own slots, one ranking across layers and
  heads) then resume, against plain transformers fed the history in the state's own chunks with, in every
  attention layer, a mask per query head that hides the slots its KV head evicted (built here from the
  slots' positions, apart from ``kvstate.masks``), within the noise floor widened by that reference's own
  spread on the compressed history; the state saved and loaded continues bitwise.
  A family whose attention cannot take per-head masks keeps one slot set per layer and the row says so.
"""

from __future__ import annotations

import itertools
import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .._compat.core import attention_implementation, cache_kwarg, decoder_layers, unbounded_cache
from ..errors import UnsupportedError
from ..layers import AttentionLayerState, attention_of
from ..masks import with_mask
from ..session import Session
from ..state import State
from .report import Floor, compare
from .rows import Matrix, Result, greedy


def compression_rows(m: Matrix) -> None:
    identity_row(m)
    per_head_row(m)


def identity_row(m: Matrix) -> None:
    """Identity compression (ratio 0) must leave the continuation bitwise unchanged."""
    from ..compress import KNorm

    def identity() -> Result:
        reference_logits, reference_tokens = greedy(m.session(state=m.prefix), m.ids, m.n)
        s = m.session(state=m.prefix)
        s.compress(KNorm(0.0))
        logits, tokens = greedy(s, m.ids, m.n)
        if not (torch.equal(logits, reference_logits) and torch.equal(tokens, reference_tokens)):
            raise AssertionError("identity compression changed the continuation (must be bitwise)")
        return logits, tokens

    m.row("kvstate: identity compression (bitwise)", "kvstate", "compress(ratio=0) then resume: bitwise equal",
          identity, {"instance": "same", "full_mask": True}, canonical=False)  # a compressed state continues


def per_head_row(m: Matrix) -> None:
    from ..compress import KVzip

    if m.inputs or not any(part is not None and part.keys is not None for part in map(attention_of, m.prefix.layers)):
        m.skipped.append("per-head compression: " + ("a media prefix" if m.inputs else "no attention layers"))
        return
    if not m.adapter.caps.head_masks:
        m.skipped.append(f"per-head compression: per-head masks are unproven on {m.adapter.caps.name}")
        return
    s = m.session(state=m.prefix)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            report = s.compress(KVzip(0.5))
        except UnsupportedError as exc:  # a typed refusal: what the row has to say
            m.skipped.append(f"per-head compression: {exc}")
            return
        except Exception as exc:  # recorded by the row below, as every crash is
            error = exc
            m.row("kvstate: per-head compression", "kvstate", "KVzip(0.5) then resume", lambda: _raise(error))
            return
    fallback = any("per-head masks" in str(w.message) for w in caught)
    compressed = s.state

    def run() -> Result:
        out = greedy(s.fork(), m.ids, m.n)
        with tempfile.TemporaryDirectory() as tmp:
            s.save(Path(tmp) / "c.kvs")
            again = greedy(Session.load(Path(tmp) / "c.kvs", m.model, canonical_chunk=m.chunk), m.ids, m.n)
        if not (torch.equal(out[0], again[0]) and torch.equal(out[1], again[1])):
            raise AssertionError("the saved compressed state continued differently after loading (must be bitwise)")
        return out

    facts: dict[str, Any] = {"instance": "same", "per_head_layers": report.per_head_layers,
             "bytes_held": round(report.bytes_held, 4), "one_slot_set_per_layer": fallback}
    reference = masked_greedy(m.model, m.ids, m.n, compressed, m.chunk)
    floor = masked_floor(m, compressed, reference)
    facts["floor"] = {"max_abs": floor.max_abs, "greedy_agree": floor.greedy_agree, "splits": floor.splits}
    m.row("kvstate: per-head compression", "kvstate", "KVzip(0.5) then resume, against per-head masked attention "
          "(its own floor: the masked reference split otherwise); saved + loaded: bitwise", run, facts, ref=reference,
          canonical=False, floor=floor)


def masked_floor(m: Matrix, state: State, reference: Result) -> Floor:
    """The matrix's floor, widened by the masked reference against itself: its prefix fed whole instead of in
    the state's chunks (one more run). A compressed history is another history, whose near-ties the
    uncompressed one's floor does not see; plain transformers' own spread on it is what a kvstate path may
    show."""
    floor = m.floor
    if m.chunk == 0:  # the reference was already fed whole
        return floor
    row = compare("floor", "plain", "", *masked_greedy(m.model, m.ids, m.n, state, 0), *reference)
    return replace(floor, max_abs=max(floor.max_abs, row.max_abs), relative=max(floor.relative, row.relative),
                   greedy_agree=min(floor.greedy_agree, row.greedy_agree), splits=[*floor.splits, 0])


def _raise(exc: Exception) -> Result:
    raise exc


def masked_greedy(model: Any, ids: torch.Tensor, n: int, state: State, chunk: int = 0) -> Result:
    """Plain transformers' greedy continuation of ``ids`` ``[1, L]`` where, in every attention layer, the
    query heads of each KV head see none of the slots that head evicted from ``state`` (the compressed
    prefix of ``T`` tokens).

    The prefix is fed in the state's own schedule (chunks ending at the multiples of ``chunk`` below ``T``,
    then ``T``; one forward when ``chunk`` is 0), the rest of ``ids`` in one forward, then one token per step,
    into a cache that keeps every token: the compressed K/V then hold the bits the reference holds, so what
    the row measures is the compression, not a prefill split (which low precision rounds otherwise). A
    model that takes no such cache is fed the whole history in one forward per step."""
    T = state.tokens_seen
    parts = {i: attention_of(layer) for i, layer in enumerate(state.layers)}
    masks = {i: _kept(state, part) for i, part in parts.items() if part is not None and part.keys is not None}
    heads = model.config.get_text_config(decoder=True).num_attention_heads
    eager = attention_implementation(model) != "sdpa"
    cache, key = unbounded_cache(model), cache_kwarg(model)

    def feed(seq: torch.Tensor, start: int) -> torch.Tensor:
        start, end = start if cache is not None else 0, seq.shape[1]
        hooks = [decoder_layers(model)[i].register_forward_pre_hook(_hook(_rows(
            kept, parts[i].window, T, start, end).repeat_interleave(heads // kept.shape[0], dim=0)[None], eager),  # type: ignore[union-attr]
            with_kwargs=True) for i, kept in masks.items()]
        try:
            with torch.no_grad():
                if cache is None:
                    return model(seq).logits[:, -1]
                return model(seq[:, start:], use_cache=True, **{key: cache}).logits[:, -1]  # type: ignore[dict-item]
        finally:
            for h in hooks:
                h.remove()

    L, cuts = ids.shape[1], range(chunk, T, chunk) if chunk > 0 else ()
    bounds = [0, L] if cache is None else [0, *cuts, T, *([L] if L > T else [])]
    for start, end in itertools.pairwise(bounds):
        logits = feed(ids[:, :end], start)
    first, seq = logits, ids
    for step in range(n):
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
        if step < n - 1:
            logits = feed(seq, seq.shape[1] - 1)
    return first, seq[:, ids.shape[1]:]


def _rows(kept: torch.Tensor, window: int | None, T: int, start: int, end: int) -> torch.Tensor:
    """``[H, end - start, end]`` bool: what the queries of tokens ``start..end-1`` may read: causal, within
    ``window``, and of the prefix's ``T`` tokens only the slots each KV head kept (``kept`` ``[H, T]``)."""
    index = torch.arange(end, device=kept.device)
    query = index[start:, None]
    allowed = (index[None, :] <= query).expand(kept.shape[0], -1, -1).clone()
    if window is not None:
        allowed &= (query - index[None, :]) < window
    if end > T:  # the continuation reads only the kept slots of each head
        allowed[:, (query[:, 0] >= T), :T] &= kept[:, None, :]
    return allowed


def _kept(state: State, layer: AttentionLayerState) -> torch.Tensor:
    """``[H, T]`` bool: which of the prefix's tokens each KV head of ``layer`` still holds (row 0)."""
    H = layer.keys.shape[1]  # type: ignore[union-attr]
    index = {tuple(p) if isinstance(p, list) else p: t for t, p in enumerate(state.positions[0].tolist())}
    positions = layer.head_positions()[0].tolist()  # type: ignore[index]
    kept = torch.zeros(H, state.tokens_seen, dtype=torch.bool, device=state.device)
    for h in range(H):
        for p in positions[h]:
            key = tuple(p) if isinstance(p, list) else p
            if key in index and (min(p) if isinstance(p, list) else p) >= 0:
                kept[h, index[key]] = True
    return kept


def _hook(mask: torch.Tensor, eager: bool) -> Any:
    def hook(module: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        form = torch.zeros(mask.shape, dtype=hidden.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(hidden.dtype).min) if eager else mask
        return with_mask(module, args, kwargs, form)
    return hook
