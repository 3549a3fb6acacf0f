"""Applying a policy to a state: score, select, record positions, optionally re-rotate keys.

Selection keeps each retained slot's original logical position in the layer's
``positions`` and marks the layer ``compressed_at``; the state's ``next_position``
is untouched, so new tokens go in at their true position (the mistake kvpress and
an MLX port made was to infer it from the compressed length). Recurrent and hybrid
layers are never touched: they have no slots. Sliding layers compress within
their window, or (``sliding="context"``) only when their window exceeds the budget.
Policies that watch the model (TOVA, SnapKV, KVzip, ExpectedAttention) need the
watched queries: kvstate re-runs the last W tokens, feeds the question, or re-reads the
context (``compress.observe``), with attention watched, and discards those forwards' state.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple, Protocol

import torch

from .._compat.core import rope_inv_freq
from ..errors import InputError, UnsupportedError
from ..layers import AttentionLayerState, LayerState
from ..protocols import AttentionObserver
from ..state import MediaItem, State
from .observe import Seen, rotate_half, watch
from .policies import Policy, ReRotate, ScoreInput

SLIDING = ("window", "context")


def compress_state(observer: AttentionObserver, model: Any, state: State, policy: Policy, *,
                   query_ids: torch.Tensor | None = None, sliding: str = "window", budget: int | None = None) -> State:
    """``state`` with each attention layer reduced by ``policy``; a ratio of 0 returns it unchanged.

    ``query_ids`` ``[B, Q]``: score with the question's attention instead of the policy's own
    question-agnostic watch (the question is not fed; ``generate`` feeds it later).
    ``sliding``: what the ratio counts. ``"window"``: each layer evicts ``ratio`` of the
    slots it holds, so a sliding layer compresses within its window. ``"context"``
    (kvpress's meaning): every layer keeps at most ``(1 - ratio) * tokens_seen`` slots,
    so a sliding layer whose window is within that budget is untouched. ``budget``: keep at
    most this many slots in every attention layer instead (the ratio is not used); a state
    already within it is returned unchanged.
    """
    _check(state, policy, query_ids, sliding, budget)
    n = len(state.layers)
    if budget is not None and all(layer.slots <= budget for layer in state.layers
                                  if isinstance(layer, AttentionLayerState)):
        return state
    if budget is None and all(policy.ratio_for(i, n) == 0 for i in range(n)):
        return state  # ratio 0: the identity, bitwise, without re-running anything
    needs = policy.needs()
    seen, tail = watch(observer, model, state, needs, query_ids) if needs.watches else ({}, 0)
    media = torch.zeros(state.tokens_seen, dtype=torch.bool, device=state.device)
    for item in state.media:
        media[item.start:item.end] = True
    length = state.tokens_seen if sliding == "context" else None
    limits = _Limits(tail, length, budget)
    results = [_compress_layer(i, n, layer, policy, seen.get(i), limits, state.tokens_seen, media)
               for i, layer in enumerate(state.layers)]
    compressed = replace(state, layers=tuple(layer for layer, _ in results),
                         media=_surviving(state, [kept for layer, kept in results  # sliding layers forget anyway
                                                  if isinstance(layer, AttentionLayerState) and layer.window is None]))
    return rerotate(model, compressed) if isinstance(policy, ReRotate) else compressed


class _Limits(NamedTuple):
    tail: int  # trailing slots that are the watched tokens
    length: int | None  # what the ratio counts (None: the layer's slots)
    budget: int | None  # absolute slots per layer


def _check(state: State, policy: Policy, query_ids: torch.Tensor | None, sliding: str, budget: int | None) -> None:
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise InputError("invalid slot budget", expected="an int >= 1", found=repr(budget)[:40])
    if not isinstance(policy, Policy):
        raise InputError("compress takes a policy", expected="a kvstate.compress policy, e.g. KVzip(0.5)",
                         found=type(policy).__name__)
    if sliding not in SLIDING:
        raise InputError("unknown sliding-window meaning", expected=SLIDING, found=repr(sliding)[:40],
                         fix='"window" compresses within each window; "context" counts the budget as kvpress does')
    if state.is_empty:
        raise InputError("nothing to compress", expected="a state with processed tokens", found="an empty state")
    if not bool(state.mask.all()):
        raise UnsupportedError("compressing padded batches is not supported", found="padding in state.mask",
                               fix="compress one row per Session")
    if any(layer.kind == "indexed_attention" for layer in state.layers):
        raise UnsupportedError("compressing dynamic sparse attention (indexed) layers is not supported",
                               found="indexed_attention layers", fix="use the state uncompressed")
    if query_ids is not None and not (policy.needs().watches):
        raise InputError(f"{type(policy).__name__} does not look at queries, so query_ids would be ignored",
                         expected="an attention-based policy (SnapKV, TOVA, KVzip, ExpectedAttention)",
                         found=type(policy).__name__, fix="drop query_ids, or pick an attention-based policy")


def _compress_layer(i: int, n: int, layer: LayerState, policy: Policy, seen: Seen | None, limits: _Limits,
                    tokens_seen: int, media: torch.Tensor) -> tuple[LayerState, torch.Tensor | None]:
    """The layer reduced by ``policy``, and the token indices its slots hold if known (batch of 1)."""
    if not isinstance(layer, AttentionLayerState) or layer.keys is None:
        return layer, None  # recurrent state has no slots to evict
    keys, values, positions = layer.keys, layer.values, layer.positions
    assert values is not None and positions is not None
    # slots are the history's tail until a compression evicts some: then their tokens are unknown here
    tokens = None if layer.compressed_at is not None or keys.shape[0] != 1 else \
        torch.arange(tokens_seen - keys.shape[2], tokens_seen, device=keys.device)
    cut = keys.shape[2]
    if layer.window is not None and keys.shape[2] > layer.window - 1:  # only the window matters from here on
        keep = layer.window - 1
        keys, values, positions = keys[:, :, -keep:], values[:, :, -keep:], positions[:, -keep:]
        tokens = None if tokens is None else tokens[-keep:]
    x = ScoreInput(i, n, keys, positions, media=None if tokens is None else media[tokens], values=values,
                   tail=limits.tail, length=limits.length, limit=limits.budget, window=layer.window,
                   **_watched(seen, keys.shape[2], cut))
    k = policy.keep_count(x)
    if k >= keys.shape[2] and (limits.budget is None or layer.slots <= limits.budget):
        return layer, tokens  # identity: the very same tensors, bitwise
    index = policy.scores(x).topk(k, dim=-1).indices.sort(dim=-1).values  # [B, k], in slot order
    B, H, _, D = keys.shape
    gather = index[:, None, :, None].expand(B, H, k, D)
    vgather = index[:, None, :, None].expand(B, H, k, values.shape[-1])
    kept_positions = positions.gather(1, index if positions.dim() == 2 else index[..., None].expand(-1, -1,
                                                                                                    positions.shape[2]))
    return (layer.with_slots(keys.gather(2, gather), values.gather(2, vgather), kept_positions,
                             compressed_at=tokens_seen), None if tokens is None else tokens[index[0]])


def _watched(seen: Seen | None, slots: int, held: int) -> dict[str, Any]:
    """The watched inputs of a layer, cut to its last ``slots`` of ``held`` slots (a sliding window)."""
    if seen is None:
        return {}
    attention = seen.attention()
    return {"attention": None if attention is None else attention[..., held - slots:held],
            "peak": None if seen.peak is None else seen.peak[..., held - slots:held],
            "queries": seen.query_block(), "future": seen.future, "horizon": seen.horizon, "scaling": seen.scaling}


def _surviving(state: State, kept: list[torch.Tensor | None]) -> tuple[MediaItem, ...]:
    """``state.media`` marked ``kept`` where every full-attention layer (with known tokens) still holds
    all of the item's slots."""
    known = [k for k in kept if k is not None]  # sorted token indices per layer
    if not state.media or not known:
        return state.media

    def whole(item: MediaItem, k: torch.Tensor) -> bool:
        return int(((k >= item.start) & (k < item.end)).sum()) == item.end - item.start

    return tuple(replace(item, kept=item.kept and all(whole(item, k) for k in known)) for item in state.media)


def rerotate(model: Any, state: State) -> State:
    """Move every layer's retained keys to positions ``0..S-1`` (RoPE by the position delta)."""
    layers = [layer for layer in state.layers if isinstance(layer, AttentionLayerState)]
    slots = {layer.slots for layer in layers}
    T = state.tokens_seen
    if any(layer.window is not None for layer in layers) or len(slots) != 1 or layers[0].positions is None \
            or layers[0].positions.dim() != 2 or len(layers) != len(state.layers):
        raise UnsupportedError("ReRotate needs full-attention layers that all keep the same number of slots, "
                               "with 1-D positions", found=sorted(slots), fix="drop ReRotate or PerLayerBudget")
    if not torch.equal(state.positions, torch.arange(T, device=state.device).expand_as(state.positions)):
        raise UnsupportedError("ReRotate needs a history fed at positions 0..T-1", fix="drop ReRotate")
    inv_freq = rope_inv_freq(model)
    (S,) = slots
    target = torch.arange(S, device=state.device).expand(state.batch_size, S)
    new_layers = tuple(layer.with_slots(rotate(layer.keys, target - layer.positions, inv_freq),  # type: ignore[arg-type]
                                        layer.values, target) for layer in layers)
    track = torch.full_like(state.positions, -1)  # evicted tokens have no place in the new frame
    track.scatter_(1, layers[0].positions, target)  # type: ignore[arg-type]
    return replace(state, layers=new_layers, positions=track, next_position=torch.full_like(state.next_position, S))


def rotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys ``[B, H, S, D]`` rotated by ``delta`` ``[B, S]`` positions (RoPE composes additively)."""
    angles = delta[..., None].double() * inv_freq.double()  # [B, S, D/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None]
    k = keys.double()
    return (k * emb.cos() + rotate_half(k) * emb.sin()).to(keys.dtype)


class Decoder(Protocol):
    """What budgeted decoding needs of a session (``kvstate.Session`` has it)."""

    @property
    def state(self) -> State: ...
    def extend(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    def compress(self, policy: Policy, *, budget: int | None = None) -> None: ...


def decode_with_budget(session: Decoder, input_ids: torch.Tensor, policy: Policy, *, budget: int, every: int,
                       max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding on at most ``budget`` slots per attention layer, by hand (the reference for
    ``Session.generate(..., compress=policy, budget=B, every=N)``).

    The prompt is fed whole; then every ``every`` new tokens the state is compressed to
    ``budget - every`` slots, so the next ``every`` tokens fit. Returns the new tokens
    ``[B, N]``. Retained slots keep their true positions, so every step is exactly
    "attention restricted to the retained slots".
    """
    check_budget(budget, every, policy)
    logits = session.extend(input_ids)
    out = []
    for step in range(max_new_tokens):
        if step % every == 0:
            session.compress(policy, budget=budget - every)
        out.append(logits.argmax(-1, keepdim=True))
        if step + 1 < max_new_tokens:
            logits = session.extend(out[-1])
    return torch.cat(out, dim=1)


def check_budget(budget: object, every: object, policy: Policy) -> None:
    """Budgeted decoding settings, checked before anything runs."""
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (budget, every)) or not 1 <= every < budget:  # type: ignore[operator]
        raise InputError("invalid decoding budget", expected="ints with 1 <= every < budget",
                         found={"budget": budget, "every": every},
                         fix="budget is the most slots a layer may hold; every new tokens it is compressed to "
                         "budget - every")
    rerun = policy.needs().rerun
    if rerun > every:  # type: ignore[operator]
        # a compressed layer cannot roll back past its compression: only the `every` tokens since can re-run
        raise InputError(f"{type(policy).__name__} re-runs its last {rerun} tokens, more than are fed between "
                         "compressions", expected=f"every >= {rerun}", found={"every": every},
                         fix=f"pass every={rerun} or more, or a policy with a smaller window")
