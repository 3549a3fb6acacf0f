"""What a policy watches before it scores: re-run tokens, a question, the whole prefill, or a re-read.

``watch`` turns a policy's ``Needs`` (or the caller's question, ``query_ids``) into
forwards the engine runs with attention watched (``Engine.observe``), and folds what
each forward shows into one ``Seen`` per attention layer, indexed by the layer's
slots in the state being compressed:

* question-agnostic (the default): the last ``rerun`` tokens are re-run on the state
  rolled back by as many; or (``prefill``) the whole context is run again from an empty
  state for its queries; or (``reconstruct``) the context is fed again after an
  instruction, chunk by chunk, as KVzip does (``kvstate.compress.reread`` scores it);
* question-aware (``query_ids``): the question is fed after the state, so attention-based
  policies see the question, as SnapKV's and TOVA's papers assume.

Every forward's state is discarded; the model and the session are left as they were.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat.watch import Watched, future_rope
from ..errors import UnsupportedError
from ..layers import attention_of
from ..protocols import AttentionObserver
from ..state import State
from .policies import Needs
from .reread import ChunkScores, feeds, sink_bound, template_prefix
from .template import Reread, reread_for

_OVERLAP = 8  # each reconstruction chunk starts after the previous chunk's last tokens (as KVzip does)
_PREFILL_CHUNK = 4096  # the whole-prefill re-run feeds at most this many tokens per forward


@dataclass
class Seen:
    """What one attention layer showed, over its ``slots`` slots in the compressed state."""

    slots: int
    rows: list[torch.Tensor] = field(default_factory=list)  # [B, Hq, q, S] per forward
    peak: torch.Tensor | None = None  # [B, Hq, S]
    queries: list[torch.Tensor] = field(default_factory=list)  # [B, Hq, q, D], RoPE undone
    scaling: float | None = None
    future: tuple[torch.Tensor, torch.Tensor] | None = None
    horizon: tuple[int, int] | None = None  # (first future position, count) that ``future`` averages over
    reread: torch.Tensor | None = None  # [B, H, S]: KVzip's score (``kvstate.compress.reread``)
    sums: list[torch.Tensor] = field(default_factory=list)  # [sum q [B, Hq, D], sum q q^T [B, Hq, D, D]], float64
    count: int = 0

    def attention(self) -> torch.Tensor | None:
        return torch.cat(self.rows, dim=2) if self.rows else None

    def query_block(self) -> torch.Tensor | None:
        return torch.cat(self.queries, dim=2) if self.queries else None

    def moments(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Mean ``[B, Hq, D]`` and (biased) covariance ``[B, Hq, D, D]`` of the queries folded in."""
        if not self.count:
            return None
        mean = self.sums[0] / self.count
        return mean, self.sums[1] / self.count - mean[..., :, None] * mean[..., None, :]


def watch(observer: AttentionObserver, model: Any, state: State, needs: Needs, query_ids: torch.Tensor | None,
          tokenizer: Any = None) -> tuple[dict[int, Seen], int]:
    """Per attention layer, what the watched forwards showed, and how many trailing slots are the
    watched tokens themselves (a re-run window; 0 otherwise)."""
    seen = {i: Seen(part.slots) for i, part in enumerate(map(attention_of, state.layers)) if part is not None}
    listener = _Listener(seen, keep_rows=query_ids is not None or bool(needs.rerun), keep_queries=needs.queries)
    if query_ids is not None:
        observer.observe(state, query_ids, listener)
        tail, after = 0, state.tokens_seen + query_ids.shape[1]
    elif needs.reconstruct:
        _reread(observer, model, state, needs, seen, tokenizer)
        tail, after = 0, state.tokens_seen
    elif needs.prefill:
        listener.sinks = needs.sinks
        T = state.tokens_seen
        observer.observe(state, state.tokens, listener, fresh=True, weights=False, chunk_size=min(T, _PREFILL_CHUNK))
        tail, after = 0, T
    else:
        T = state.tokens_seen
        observer.observe(state, state.tokens[:, T - needs.rerun:], listener, rerun=needs.rerun)
        tail, after = needs.rerun, T
    if needs.queries:
        _future(model, state, seen, after, needs.future)
    return seen, tail


def _reread(observer: AttentionObserver, model: Any, state: State, needs: Needs, seen: dict[int, Seen],
            tokenizer: Any) -> None:
    """KVzip's re-read, chunk by chunk: each chunk in one forward, scored as the reference does
    (``softmax="chunk"``) or by the peak of the model's attention weights (``"model"``). The chat template's
    prefix at the state's start is not re-read under ``needs.prefix`` "sink" (it is the sinks) or "evict"."""
    plan = reread_for(model, tokenizer) if needs.prompt is None else Reread(needs.prompt, needs.prompt, (), "given")
    skip = template_prefix(state, plan) if needs.prefix != "reread" and needs.prompt is None else 0
    kept = sink_bound(state, skip) if needs.prefix == "sink" else 0
    listener: Any
    for piece in feeds(state, plan, needs.chunk, overlap=_OVERLAP, legacy=needs.prompt is not None, skip=skip):
        if needs.softmax == "model":
            listener = _Listener(seen, keep_rows=False, keep_queries=False)
        else:
            listener = ChunkScores(state, seen, piece, max(needs.sinks, kept), kept)
        observer.observe(state, piece.ids, listener, chunk_size=piece.ids.shape[1],
                         weights=needs.softmax == "model", norms=needs.normalize)


def reconstruction(tokens: torch.Tensor, prompt: tuple[int, ...], chunk: int) -> list[torch.Tensor]:
    """The re-read feeds of a context ``[B, T]`` with a given instruction ``prompt``: prompt + chunk, later
    chunks after the last tokens of the one before (kvstate's earlier KVzip; no chat suffix)."""
    head = torch.tensor([prompt], dtype=tokens.dtype, device=tokens.device).expand(tokens.shape[0], -1)
    out, T = [], tokens.shape[1]
    for start in range(0, T, chunk):
        lead = tokens[:, max(start - _OVERLAP, 0):start]
        out.append(torch.cat([head, lead, tokens[:, start:start + chunk]], dim=1))
    return out


class _Listener:
    """Folds each watched forward into the layers' ``Seen``: attention rows and peaks (eager weights), queries
    with their RoPE undone, or (``sinks`` set: the whole-prefill re-run) running query moments."""

    def __init__(self, seen: dict[int, Seen], *, keep_rows: bool, keep_queries: bool) -> None:
        self.seen, self.keep_rows, self.keep_queries = seen, keep_rows, keep_queries
        self.sinks: int | None = None

    def __call__(self, first_key: int, watched: Watched) -> None:
        seen = self.seen.get(watched.layer)
        if seen is None:
            return
        seen.scaling = watched.scaling
        if self.sinks is not None:
            _fold_moments(seen, watched, first_key + watched.key.shape[2] - watched.query.shape[2], self.sinks)
            return
        weights = watched.weights
        assert weights is not None  # these watches run eager attention
        B, H, q, K = weights.shape
        part = weights.new_zeros(B, H, q, seen.slots, dtype=torch.float32)
        lo, hi = max(first_key, 0), min(seen.slots, first_key + K)  # columns that are the state's slots
        if hi > lo:
            part[..., lo:hi] = weights[..., lo - first_key:hi - first_key].float()
        top = part.amax(dim=2)
        seen.peak = top if seen.peak is None else torch.maximum(seen.peak, top)
        if self.keep_rows:
            seen.rows.append(part)
        if self.keep_queries:
            seen.queries.append(unrotate(watched.query, watched.rope))


def _fold_moments(seen: Seen, watched: Watched, first_token: int, sinks: int) -> None:
    """Add the queries of tokens ``first_token..`` (those at index ``>= sinks``) to the running sums."""
    skip = min(max(sinks - first_token, 0), watched.query.shape[2])
    q = unrotate(watched.query[:, :, skip:], None if watched.rope is None else
                 (watched.rope[0][:, skip:], watched.rope[1][:, skip:])).double()
    if not q.shape[2]:
        return
    total, outer = q.sum(dim=2), torch.einsum("bhqd,bhqe->bhde", q, q)
    seen.sums = [total, outer] if not seen.sums else [seen.sums[0] + total, seen.sums[1] + outer]
    seen.count += q.shape[2]


def unrotate(query: torch.Tensor, rope: Any) -> torch.Tensor:
    """Queries ``[B, H, q, D]`` with their RoPE undone (``rope``: the ``(cos, sin)`` ``[B, q, Dr]`` they were
    rotated with; None: no RoPE). The rotation is orthogonal up to a per-frequency scale, divided out."""
    q = query.float()
    if rope is None:
        return q
    cos, sin = rope[0][:, None].float(), rope[1][:, None].float()
    if cos.dim() != 4 or cos.shape[-1] > q.shape[-1]:
        raise UnsupportedError("cannot undo this model's RoPE", expected="(cos, sin) of shape [B, q, Dr]",
                               found=tuple(rope[0].shape), fix="use a policy that does not need queries")
    r = cos.shape[-1]
    part = q[..., :r]
    plain = (part * cos - rotate_half(part) * sin) / (cos * cos + sin * sin)
    return torch.cat([plain, q[..., r:]], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's quarter turn of the last dim: ``[x1, x2] -> [-x2, x1]``."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _future(model: Any, state: State, seen: dict[int, Seen], start: int, count: int) -> None:
    """Each layer's mean RoPE tables over the ``count`` positions after ``start``."""
    if state.positions.dim() == 3:
        raise UnsupportedError("ExpectedAttention needs 1-D positions", found="multimodal (M-RoPE) positions",
                               fix="use KVzip, KNorm or a question-aware policy")
    begin = int(state.next_position.max()) + (start - state.tokens_seen)
    positions = torch.arange(begin, begin + count, device=state.device)[None]
    for i, layer_seen in seen.items():
        table = future_rope(model, i, positions)
        layer_seen.future = None if table is None else (table[0][0].mean(0), table[1][0].mean(0))
        layer_seen.horizon = (begin, count)
