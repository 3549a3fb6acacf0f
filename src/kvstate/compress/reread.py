"""KVzip's re-read: the feeds, and the score each slot gets from them, as the reference computes it.

Each re-read chunk goes in as one forward after the state: ``instruction + suffix + chunk``
(``kvstate.compress.template``; tokens of images and videos are left out, their pixels are
gone). In every attention layer the re-read's post-RoPE queries ``[B, Hq, q, D]`` are scored
against the state's own keys, per KV head: softmax over the first ``sinks`` slots, the
slots whose positions fall in the chunk, and the re-read's own keys (causal among them),
scaled by ``1/sqrt(d)``, in float32; a slot's score is the most any query of its head's
group paid it (Kim et al. 2025; kvpress's ``KVzipPress.score_kvzip``). The softmax is
the reference's, not the layer's: a sliding layer's slots are scored as if its window
were open, as the reference's scores of a full layer are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._compat.lse import attention_lse
from .._compat.watch import Watched
from ..errors import UnsupportedError
from ..layers import AttentionLayerState, attention_of
from ..state import State
from .template import Reread

_ROWS = 64  # re-read queries scored at once: the block of logits stays in cache (bench_kvzip_cost.py)


@dataclass(frozen=True)
class Piece:
    """One re-read forward: ``ids`` ``[B, L]`` and the 1-D position range ``[lo, hi]`` of its chunk."""

    ids: torch.Tensor
    lo: int
    hi: int


def feeds(state: State, plan: Reread, chunk: int, overlap: int, legacy: bool, skip: int = 0) -> list[Piece]:
    """The re-read forwards of the state's tokens after the first ``skip``, ``chunk`` at a time (``legacy``: the
    given instruction, then the previous chunk's last ``overlap`` tokens, then the chunk, with no suffix:
    kvstate's earlier re-read)."""
    tokens, T = state.tokens, state.tokens_seen
    text = torch.ones(T, dtype=torch.bool, device=tokens.device)
    for item in state.media:
        text[item.start:item.end] = False
    flat = _flat(state)
    out: list[Piece] = []
    for start in range(skip, T, chunk):
        end = min(start + chunk, T)
        body = tokens[:, start:end][:, text[start:end]]
        before = tokens[:, skip:start][:, text[skip:start]][:, -overlap:] if start > skip else tokens[:, :0]
        if legacy:
            parts = [_ids(plan.first, tokens), before, body]
        elif start == skip:
            parts = [_ids(plan.first, tokens), _ids(plan.suffix, tokens), body]
        else:
            parts = [_ids(plan.later, tokens), before, _ids(plan.suffix, tokens), body]
        span = flat[:, start:end]
        out.append(Piece(torch.cat(parts, dim=1), int(span.min()), int(span.max())))
    return out


def template_prefix(state: State, plan: Reread) -> int:
    """How many of the state's first tokens are the chat template's prefix (``plan.prefix``; 0 when some row
    does not start with it, or it would leave nothing to re-read)."""
    P = len(plan.prefix)
    if not P or state.tokens_seen <= P or any(item.start < P for item in state.media):
        return 0
    head = torch.tensor(plan.prefix, dtype=state.tokens.dtype, device=state.tokens.device)
    return P if bool((state.tokens[:, :P] == head).all()) else 0


def sink_bound(state: State, tokens: int) -> int:
    """The first position after the state's first ``tokens`` tokens (positions below it are sinks)."""
    return int(_flat(state)[:, :tokens].max()) + 1 if tokens else 0


def _time(layer: AttentionLayerState) -> torch.Tensor:
    """``[B, H, S]``: each slot's 1-D position per head (the largest component of an M-RoPE one; negative on
    padding)."""
    positions = layer.head_positions()
    assert positions is not None  # a scored layer holds slots
    return positions if positions.dim() == 3 else positions.amax(-1)


def _flat(state: State) -> torch.Tensor:
    return state.positions if state.positions.dim() == 2 else state.positions.amax(-1)


def _ids(ids: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor([ids], dtype=like.dtype, device=like.device).expand(like.shape[0], -1)


class ChunkScores:
    """The listener of one re-read forward: folds each layer's KVzip score ``[B, H, S]`` into ``seen.reread``."""

    def __init__(self, state: State, seen: dict[int, object], piece: Piece, sinks: int, kept: int = 0) -> None:
        """``sinks``: slots at positions below it are in every softmax; below ``kept`` they score ``inf``
        (always kept: the chat template's prefix as the reference's sinks)."""
        parts = {i: attention_of(layer) for i, layer in enumerate(state.layers)}
        self.layers = {i: part for i, part in parts.items() if part is not None and i in seen and part.keys is not None}
        self.seen, self.piece, self.sinks, self.kept = seen, piece, sinks, kept

    def __call__(self, first_key: int, watched: Watched) -> None:
        layer = self.layers.get(watched.layer)
        if layer is None:
            return
        assert layer.keys is not None and layer.values is not None
        if watched.key.shape[1] != layer.keys.shape[1]:  # e.g. MLA: the cache holds a latent, not the heads
            raise UnsupportedError("KVzip scores the state's keys per KV head, and this family's attention reads "
                                   "other heads than its cache holds", expected=f"{layer.keys.shape[1]} KV heads",
                                   found=f"{watched.key.shape[1]} in layer {watched.layer}'s attention",
                                   fix="use KVzip(softmax='model', heads=False), or another policy")
        inside, subset = self._domain(layer)
        cols = subset.any(dim=1).any(dim=0).nonzero().flatten()
        if cols.numel() == 0:
            return
        score, _ = _score(watched, layer.keys[:, :, cols], layer.values[:, :, cols], subset[:, :, cols])
        self._fold(watched.layer, inside, cols, score)

    def attend(self, first_key: int, watched: Watched) -> torch.Tensor | None:
        """The layer's attention output ``[B, q, Hq, Dv]`` computed from the scores' own softmax, where that is the
        layer's softmax (every key the call reads is a scored slot or a re-read token, no window, KVzip's scale;
        the caller checked the family attends as Llama does); None otherwise (the model's attention then runs
        and ``__call__`` scores). It saves the layer's own attention: a third of a re-read's cost on SmolLM2."""
        layer = self.layers.get(watched.layer)
        q, D = watched.query.shape[2], watched.query.shape[3]
        if layer is None or layer.keys is None or layer.window is not None or first_key != 0 \
                or watched.key.shape[1] != layer.keys.shape[1] or watched.key.shape[2] != layer.keys.shape[2] + q \
                or abs(watched.scaling - D ** -0.5) > 1e-9 * D ** -0.5:
            return None
        inside, subset = self._domain(layer)
        if not bool(subset.all()):
            return None
        C = layer.keys.shape[2]
        score, out = _score(watched, watched.key[:, :, :C], watched.value[:, :, :C], subset, watched.value)
        self._fold(watched.layer, inside, torch.arange(C, device=subset.device), score)
        assert out is not None
        return out.transpose(1, 2).contiguous().to(watched.query.dtype)

    def _domain(self, layer: AttentionLayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, H, S]`` bool each: the slots of this chunk, and those in its softmax (the chunk's and the sinks)."""
        time = _time(layer)
        valid = time >= 0
        inside = valid & (time >= self.piece.lo) & (time <= self.piece.hi)
        return inside, inside | (valid & (time < self.sinks))

    def _fold(self, index: int, inside: torch.Tensor, cols: torch.Tensor, score: torch.Tensor) -> None:
        full = torch.zeros(inside.shape, dtype=torch.float32, device=inside.device)
        full[:, :, cols] = score
        full = full.masked_fill(~inside, 0.0)
        if self.kept:
            time = _time(self.layers[index])
            full = full.masked_fill((time >= 0) & (time < self.kept), float("inf"))
        seen = self.seen[index]
        previous = getattr(seen, "reread", None)
        seen.reread = full if previous is None else torch.maximum(previous, full)  # type: ignore[attr-defined]


def _score(watched: Watched, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
           attend: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[B, H, C]``: the most attention any re-read query of each head's group pays each of the ``C`` state
    slots ``keys`` ``[B, H, C, D]`` (``allowed`` ``[B, H, C]``: in the softmax for that head); with ``attend``
    (the values ``[B, H, C + q, Dv]`` of those slots and of the re-read; every slot allowed), also the
    attention output ``[B, Hq, q, Dv]`` of that softmax.

    The softmax's normaliser ``lse`` of each query comes first (``_normaliser``); a slot's score is then
    ``exp(max(q . k - lse))``: one matrix product and one max per block of queries, no softmax pass over the
    matrix (the scoring is memory-bound: ``bench/bench_kvzip_cost.py``)."""
    B, Hq, q, D = watched.query.shape
    H, C = keys.shape[1], keys.shape[2]
    G = Hq // H
    queries = (watched.query.float() * D ** -0.5).view(B, H, G, q, D)  # a power of two for D = 4^k: exact
    keys = keys.float()
    hidden = None if bool(allowed.all()) else (~allowed).reshape(B * H, 1, C)
    lse, out = _normaliser(watched, queries, keys, hidden, attend)  # [B, H, G, q]
    plus = watched.hidden_norm is not None and watched.out_proj is not None  # KVzip+: rows / ||h||, columns * ||W_o v||
    bias = lse + watched.hidden_norm.float().log()[:, None, None] if plus else lse  # type: ignore[union-attr]
    best: torch.Tensor | None = None  # [B, H, G, C]: the largest q . k - lse over the rows so far
    columns = keys.reshape(B * H, C, D).transpose(1, 2)
    for r0 in range(0, q, _ROWS):
        r = min(_ROWS, q - r0)
        rows = queries[:, :, :, r0:r0 + r].reshape(B * H, G * r, D)
        logits = torch.baddbmm(bias[:, :, :, r0:r0 + r].reshape(B * H, G * r, 1).neg(), rows, columns)
        if hidden is not None:
            logits.masked_fill_(hidden, float("-inf"))
        peak = logits.view(B, H, G, r, C).amax(dim=3)
        best = peak if best is None else torch.maximum(best, peak)
    assert best is not None  # a re-read feeds at least one token
    best = best.exp_()
    if plus:
        best = best.mul_(_column_norms(watched, values, G))  # [B, H, G, C]
    return best.amax(dim=2), out


def _normaliser(watched: Watched, queries: torch.Tensor, keys: torch.Tensor, hidden: torch.Tensor | None,
                attend: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``lse`` ``[B, H, G, q]`` of the reference's softmax (the allowed state slots, then the re-read causally;
    ``queries`` already scaled), and with ``attend`` its output ``[B, Hq, q, Dv]``: the state's part and the
    re-read's part each in one kernel call (``attention_lse``), merged by their normalisers."""
    B, H, G, q, D = queries.shape
    C = keys.shape[2]
    own = watched.key[:, :, -q:].float()
    own_values = attend[:, :, C:].float() if attend is not None else own  # the flash op wants Dv == D
    o2, l2 = attention_lse(queries.view(B, H * G, q, D), own, own_values, 1.0, causal=True)
    l2 = l2.reshape(B, H, G, q)  # the kernels' outputs may be strided
    if hidden is None:
        state_values = attend[:, :, :C].float() if attend is not None else keys
        o1, l1 = attention_lse(queries.reshape(B, H, G * q, D), keys, state_values, 1.0, causal=False)
        l1 = l1.reshape(B, H, G, q)
    else:
        o1, l1 = None, torch.cat([_masked_lse(queries[:, :, :, r0:r0 + _ROWS], keys, hidden)
                                  for r0 in range(0, q, _ROWS)], dim=3)
    lse = torch.logaddexp(l1, l2)
    if attend is None or o1 is None:
        return lse, None
    share = [(part - lse).exp()[..., None] for part in (l1, l2)]  # each part's weight in the whole softmax
    out = o1.reshape(B, H, G, q, -1) * share[0] + o2.reshape(B, H, G, q, -1) * share[1]
    return lse, out.reshape(B, H * G, q, -1)


def _masked_lse(rows: torch.Tensor, keys: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``[B, H, G, r]``: log-sum-exp of ``rows`` ``[B, H, G, r, D]`` over the allowed slots of ``keys``."""
    B, H, G, r, D = rows.shape
    logits = torch.bmm(rows.reshape(B * H, G * r, D), keys.reshape(B * H, -1, D).transpose(1, 2))
    return logits.masked_fill_(hidden, float("-inf")).logsumexp(-1).view(B, H, G, r)


def _column_norms(watched: Watched, values: torch.Tensor, groups: int) -> torch.Tensor:
    """``[B, H, G, C]``: ``||W_o v||`` of each slot's value through the output projection of each query head."""
    W = watched.out_proj.float()  # type: ignore[union-attr]  # [hidden, Hq * Dv]
    H, Dv = values.shape[1], values.shape[3]
    blocks = W.view(W.shape[0], H, groups, Dv)
    gram = torch.einsum("jhgd,jhge->hgde", blocks, blocks)  # W_o^T W_o per query head
    v = values.float()
    return torch.einsum("bhcd,hgde,bhce->bhgc", v, gram, v).clamp_min(0).sqrt()
