"""The compression rows: ratio 0 is the identity, and a real compression continues as its masks say.

``compression_rows`` checks, on the matrix's prefix:

* identity: ``compress(KNorm(0.0))`` then resume, bitwise the uncompressed continuation;
* per head: ``compress(KVzip(0.5))`` (every KV head keeps its own slots, one ranking across layers and
  heads) then resume, against plain transformers on the whole history with, in every attention layer,
  a mask per query head that hides the slots its KV head evicted (built here from the slots' positions,
  apart from ``kvstate.masks``), within the noise floor; the state saved and loaded continues bitwise.
  A family whose attention cannot take per-head masks keeps one slot set per layer and the row says so.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from .._compat.core import attention_implementation, decoder_layers
from ..errors import UnsupportedError
from ..layers import AttentionLayerState, attention_of
from ..masks import with_mask
from ..session import Session
from ..state import State
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

    facts = {"instance": "same", "per_head_layers": report.per_head_layers,
             "bytes_held": round(report.bytes_held, 4), "one_slot_set_per_layer": fallback}
    m.row("kvstate: per-head compression", "kvstate", "KVzip(0.5) then resume, against per-head masked attention; "
          "saved + loaded: bitwise", run, facts, ref=masked_greedy(m.model, m.ids, m.n, compressed), canonical=False)


def _raise(exc: Exception) -> Result:
    raise exc


def masked_greedy(model: Any, ids: torch.Tensor, n: int, state: State) -> Result:
    """Plain transformers' greedy continuation of ``ids`` ``[1, L]`` where, in every attention layer, the
    query heads of each KV head see none of the slots that head evicted from ``state`` (the compressed
    prefix), one full forward per step."""
    T = state.tokens_seen
    parts = {i: attention_of(layer) for i, layer in enumerate(state.layers)}
    masks = {i: _kept(state, part) for i, part in parts.items() if part is not None and part.keys is not None}
    config = model.config.get_text_config(decoder=True)
    eager = attention_implementation(model) != "sdpa"
    seq, first = ids, None
    for _ in range(n):
        L = seq.shape[1]
        hooks = []
        for i, kept in masks.items():
            window = parts[i].window  # type: ignore[union-attr]
            allowed = torch.ones(kept.shape[0], L, L, dtype=torch.bool, device=ids.device).tril()
            allowed[:, T:, :T] &= kept[:, None, :]  # the continuation reads only the kept slots of each head
            if window is not None:
                index = torch.arange(L, device=ids.device)
                allowed &= (index[:, None] - index[None, :]) < window
            mask = allowed.repeat_interleave(config.num_attention_heads // kept.shape[0], dim=0)[None]
            hooks.append(decoder_layers(model)[i].register_forward_pre_hook(_hook(mask, eager), with_kwargs=True))
        try:
            with torch.no_grad():
                logits = model(seq).logits[:, -1]
        finally:
            for h in hooks:
                h.remove()
        first = logits if first is None else first
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert first is not None
    return first, seq[:, ids.shape[1]:]


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
