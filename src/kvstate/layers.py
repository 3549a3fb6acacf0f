"""Per-layer generation state: one small protocol, the same verbs for every kind.

Layout, stated once: keys and values are ``[B, H, S, D]`` (batch, KV heads, slots
stored, head dim), as in transformers; ``positions`` is ``[B, S]`` int64, the
logical (RoPE) position of every stored slot (``[B, S, R]`` for multimodal RoPE).

After a per-head compression (``kvstate.compress``) every KV head of an attention layer
holds its own slots: ``per_head`` is set and ``positions`` is ``[B, H, S]`` (``[B, H, S, R]``),
one position per head and slot. Each head's slots sit at the end of the ``S`` slots
(oldest first) and the layer is padded at the front to its largest head: a padding slot
has position ``PAD`` (-1) and zero K/V, and no query ever sees it (``kvstate.masks``).
Slots appended later are the same for every head. Right-aligned, a slot that a
sliding layer drops from the front of its window is always one its window has left.

Two quantities are kept apart and never inferred from tensor contents:

* ``tokens_seen`` - how many token slots (padding included) have passed through
  the layer; transformers builds masks from it;
* ``slots`` - how many of them are stored right now (``S``).

Layer states are immutable: every verb returns a new object and no tensor is ever
written in place. That is what makes ``Session.fork`` free and safe.

Recurrent layers (conv + SSM / linear-attention / RG-LRU states) have no slots and
cannot be cropped; ``checkpointed`` marks them, and ``State`` keeps snapshots of
them at call boundaries so that rollback stays possible there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .errors import RollbackError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
RECURRENT = "recurrent"
HYBRID = "hybrid"
INDEXED = "indexed_attention"
STATELESS = "stateless"
PAD = -1  # the position of a padding slot of a per-head layer


class LayerState(ABC):
    """The protocol every per-layer state implements; it owns the two counters.

    ``tokens_seen`` is fixed at construction (a verb returns a new layer); ``slots`` is
    0 here, and a kind that stores slots counts them from its own tensors.
    """

    checkpointed: bool = False  # True: cannot roll back, so State snapshots it at boundaries

    def __init__(self, tokens_seen: int) -> None:
        self._tokens_seen = tokens_seen

    @property
    @abstractmethod
    def kind(self) -> str:
        """Layer kind, e.g. ``full_attention`` or ``sliding_attention``."""

    @property
    def tokens_seen(self) -> int:
        """Token slots processed by this layer, padding included."""
        return self._tokens_seen

    @property
    def slots(self) -> int:
        """Slots currently stored (``S``)."""
        return 0

    @abstractmethod
    def rollback_limit(self, n_tokens: int) -> str | None:
        """Why the layer cannot return to ``n_tokens`` seen, or None if it can."""

    @abstractmethod
    def truncated(self, n_tokens: int) -> LayerState:
        """The state after ``n_tokens`` tokens; raises ``RollbackError`` if impossible."""

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Named tensors, for saving and byte counts."""

    @abstractmethod
    def meta(self) -> dict[str, object]:
        """JSON-able scalars that complete ``tensors()``."""

    @abstractmethod
    def to(self, device: torch.device | str) -> LayerState:
        """A copy on another device."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def entries(self) -> int:
        """K/V entries held (slots x heads x rows, padding not counted); 0 for a kind without K/V."""
        return 0

    @property
    def kv_nbytes(self) -> int:
        """Bytes of the keys and values held (a per-head layer's padding included)."""
        return sum(t.numel() * t.element_size() for name, t in self.tensors().items() if name in ("keys", "values"))

    @classmethod
    @abstractmethod
    def from_parts(cls, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> LayerState:
        """Rebuild from ``meta()`` and ``tensors()``; inputs are already validated."""


class AttentionLayerState(LayerState):
    """K/V of one attention layer: full attention, or a sliding window.

    Args:
        keys, values: ``[B, H, S, D]`` retained slots, oldest first.
        positions: ``[B, S]`` int64 logical position of each retained slot.
        tokens_seen: token slots processed so far (``>= S``).
        window: sliding window size, or None for full attention.
        reserve: extra slots a sliding layer keeps beyond ``window - 1`` and beyond the slots of its
            last append, so that the state can roll back by up to ``reserve`` tokens past the
            start of that append.
        compressed_at: ``tokens_seen`` when slots were last evicted by compression;
            the retained slots are then no longer the tail of the history, so the
            layer can only roll back to that length or later.
        per_head: each KV head holds its own slots; ``positions`` is then ``[B, H, S(, R)]``
            with ``PAD`` on padding slots (see the module docstring).
    """

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None,
                 positions: torch.Tensor | None, tokens_seen: int,
                 window: int | None = None, reserve: int = 0, compressed_at: int | None = None,
                 per_head: bool = False) -> None:
        super().__init__(tokens_seen)
        self.keys = keys
        self.values = values
        self.positions = positions
        self.window = window
        self.reserve = reserve
        self.compressed_at = compressed_at
        self.per_head = per_head and keys is not None

    @property
    def kind(self) -> str:
        return FULL_ATTENTION if self.window is None else SLIDING_ATTENTION

    @classmethod
    def empty(cls, window: int | None = None, reserve: int = 0) -> AttentionLayerState:
        return cls(None, None, None, 0, window, reserve)

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[-2])

    @property
    def slot_dim(self) -> int:
        """The dim of ``positions`` that counts slots: 2 for a per-head layer, else 1."""
        return 2 if self.per_head else 1

    @property
    def valid(self) -> torch.Tensor | None:
        """``[B, H, S]`` bool: the slot holds a token for that head (False on padding); None: every slot
        of every head does (a layer whose heads share their slots)."""
        if not self.per_head:
            return None
        positions = self.positions
        assert positions is not None
        return (positions if positions.dim() == 3 else positions[..., 0]) != PAD

    @property
    def entries(self) -> int:
        """K/V entries held (slots x heads x rows), padding not counted."""
        if self.keys is None:
            return 0
        valid = self.valid
        B, H, S, _ = self.keys.shape
        return B * H * S if valid is None else int(valid.sum())

    def head_positions(self) -> torch.Tensor | None:
        """``[B, H, S(, R)]``: each head's slot positions (shared ones repeated for every head)."""
        if self.positions is None or self.per_head:
            return self.positions
        assert self.keys is not None
        B, H = self.keys.shape[:2]
        return self.positions[:, None].expand(B, H, *self.positions.shape[1:])

    def joined(self, new_positions: torch.Tensor, last: int) -> torch.Tensor:
        """The positions of the last ``last`` slots after slots at ``new_positions`` ``[B, Q(, R)]`` are
        appended (the same positions for every head)."""
        if self.per_head:
            assert self.positions is not None
            H = self.positions.shape[1]
            new = new_positions[:, None].expand(-1, H, *new_positions.shape[1:])
            return torch.cat([self.positions, new], dim=2)[:, :, self.positions.shape[2] + new.shape[2] - last:]
        old = self.positions if self.positions is not None else new_positions[:, :0]
        return torch.cat([old, new_positions], dim=1)[:, old.shape[1] + new_positions.shape[1] - last:]

    @property
    def keep(self) -> int | None:
        """Slots this layer retains after an update, besides the update's own (None: all of them)."""
        return None if self.window is None else self.window - 1 + self.reserve

    def needed(self, n_tokens: int) -> int:
        """Slots the next query needs when ``n_tokens`` have been seen."""
        return n_tokens if self.window is None else min(n_tokens, self.window - 1)

    def appended(self, keys: torch.Tensor, values: torch.Tensor,
                 positions: torch.Tensor, tokens_seen: int) -> AttentionLayerState:
        """A new state whose retained slots end with the given ones.

        ``keys``/``values`` ``[B, H, S', D]`` and ``positions`` ``[B, S']`` are the
        full retained tensors after the update; this trims them to ``keep`` plus the slots the
        update added. So the state can always roll back ``reserve`` tokens past the start of its
        last append: a canonical resume restarts at the last cut before where the history ended,
        after the whole answer was appended at once (the canonical schedule; trimming to ``keep`` alone made a
        chat longer than the window unable to resume: each turn fed its whole history again).
        """
        keep = self.keep
        if keep is not None:
            keep += max(tokens_seen - self.tokens_seen, 0)
        if keep is not None and keys.shape[-2] > keep:
            keys, values = keys[:, :, -keep:], values[:, :, -keep:]
            positions = positions[:, :, -keep:] if self.per_head else positions[:, -keep:]
        return self.with_slots(keys, values, positions, tokens_seen)

    def with_slots(self, keys: torch.Tensor | None, values: torch.Tensor | None, positions: torch.Tensor | None,
                   tokens_seen: int | None = None, compressed_at: int | None = None,
                   per_head: bool | None = None) -> AttentionLayerState:
        """The same layer (window, reserve, compression mark, head layout) holding other slots."""
        return AttentionLayerState(keys, values, positions, self.tokens_seen if tokens_seen is None else tokens_seen,
                                   self.window, self.reserve,
                                   self.compressed_at if compressed_at is None else compressed_at,
                                   self.per_head if per_head is None else per_head)

    def rollback_limit(self, n_tokens: int) -> str | None:
        drop = self.tokens_seen - n_tokens
        if drop < 0:
            return f"cannot roll forward from {self.tokens_seen} to {n_tokens} tokens"
        if self.compressed_at is not None:
            if n_tokens < self.compressed_at:
                return f"layer was compressed at {self.compressed_at} tokens; it cannot return to {n_tokens}"
            return None if self.slots >= drop else f"only {self.slots} slots retained, {drop} to drop"
        if self.slots - drop < self.needed(n_tokens):
            return (f"{self.kind} layer (window {self.window}) retains {self.slots} slots of "
                    f"{self.tokens_seen} tokens; returning to {n_tokens} tokens needs "
                    f"{self.needed(n_tokens)} of them but only {max(self.slots - drop, 0)} remain")
        return None

    def truncated(self, n_tokens: int) -> AttentionLayerState:
        reason = self.rollback_limit(n_tokens)
        if reason is not None:
            raise RollbackError(
                "cannot roll back this layer",
                expected=f"a return at most {self.reserve} tokens (the reserve) before where the last append started",
                found=reason, fix="create the Session with a larger sliding_reserve, or reset() "
                "and re-feed the history")
        drop = self.tokens_seen - n_tokens
        if drop == 0:
            return self
        if self.slots - drop == 0:
            return self.with_slots(None, None, None, n_tokens)
        end = self.slots - drop
        positions = self.positions[:, :, :end] if self.per_head else self.positions[:, :end]  # type: ignore[index]
        return self.with_slots(self.keys[:, :, :end], self.values[:, :, :end],  # type: ignore[index]
                               positions, n_tokens)

    @property
    def compressed(self) -> bool:
        return self.compressed_at is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        if self.keys is None:
            return {}
        return {"keys": self.keys, "values": self.values, "positions": self.positions}  # type: ignore[dict-item]

    @classmethod
    def from_parts(cls, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> AttentionLayerState:
        window = meta["window"]
        compressed_at = meta.get("compressed_at")
        return cls(tensors.get("keys"), tensors.get("values"), tensors.get("positions"),
                   int(meta["tokens_seen"]),  # type: ignore[call-overload]
                   None if window is None else int(window),  # type: ignore[call-overload]
                   int(meta.get("reserve") or 0),  # type: ignore[call-overload]
                   None if compressed_at is None else int(compressed_at),  # type: ignore[call-overload]
                   meta.get("per_head") is True)

    def meta(self) -> dict[str, object]:
        meta: dict[str, object] = {"kind": self.kind, "tokens_seen": self.tokens_seen, "slots": self.slots,
                                   "window": self.window, "reserve": self.reserve, "compressed_at": self.compressed_at}
        if self.per_head:  # only then: a layer whose heads share their slots keeps the header it always had
            meta.update(per_head=True, entries=self.entries)
        return meta

    def to(self, device: torch.device | str) -> AttentionLayerState:
        if self.keys is None:
            return self
        return self.with_slots(self.keys.to(device), self.values.to(device),  # type: ignore[union-attr]
                               self.positions.to(device))  # type: ignore[union-attr]


class RecurrentLayerState(LayerState):
    """Conv and recurrent states of one layer, keyed by state index.

    Args:
        conv: ``{i: [B, C, K]}`` conv windows (K as transformers stores it).
        recurrent: ``{i: [B, ...]}`` SSM / linear-attention / RG-LRU states.
        tokens_seen: tokens folded into these states.
    """

    checkpointed = True

    def __init__(self, conv: dict[int, torch.Tensor], recurrent: dict[int, torch.Tensor],
                 tokens_seen: int) -> None:
        super().__init__(tokens_seen)
        self.conv = dict(conv)
        self.recurrent = dict(recurrent)

    @property
    def kind(self) -> str:
        return RECURRENT

    def rollback_limit(self, n_tokens: int) -> str | None:
        if n_tokens == self.tokens_seen:
            return None
        return (f"recurrent layer has folded {self.tokens_seen} tokens into its state and cannot "
                f"return to {n_tokens} without a checkpoint")

    def truncated(self, n_tokens: int) -> RecurrentLayerState:
        reason = self.rollback_limit(n_tokens)
        if reason is not None:
            raise RollbackError("cannot roll back a recurrent layer", expected="a checkpoint at that length",
                                found=reason, fix="truncate to a checkpointed length (state.checkpoints)")
        return self

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f"conv.{i}": t for i, t in self.conv.items()}
        out.update({f"recurrent.{i}": t for i, t in self.recurrent.items()})
        return out

    def meta(self) -> dict[str, object]:
        return {"kind": self.kind, "tokens_seen": self.tokens_seen, "slots": 0, "window": None, "reserve": 0}

    @classmethod
    def from_parts(cls, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> RecurrentLayerState:
        conv = {int(k.split(".")[1]): t for k, t in tensors.items() if k.startswith("conv.")}
        rec = {int(k.split(".")[1]): t for k, t in tensors.items() if k.startswith("recurrent.")}
        return cls(conv, rec, int(meta["tokens_seen"]))  # type: ignore[call-overload]

    def to(self, device: torch.device | str) -> RecurrentLayerState:
        return RecurrentLayerState({i: t.to(device) for i, t in self.conv.items()},
                                   {i: t.to(device) for i, t in self.recurrent.items()}, self.tokens_seen)


class _WithAttention(LayerState):
    """A layer whose slots are those of its attention part (``self.attention``)."""

    attention: AttentionLayerState

    @property
    def slots(self) -> int:
        return self.attention.slots

    @property
    def positions(self) -> torch.Tensor | None:
        return self.attention.positions

    @property
    def entries(self) -> int:
        return self.attention.entries

    @property
    def compressed(self) -> bool:
        return self.attention.compressed

    def meta(self) -> dict[str, object]:
        return {**self.attention.meta(), "kind": self.kind}


class HybridLayerState(_WithAttention):
    """One layer that holds both attention K/V and recurrent state (e.g. Falcon-H1)."""

    checkpointed = True

    def __init__(self, attention: AttentionLayerState, recurrent: RecurrentLayerState) -> None:
        super().__init__(recurrent.tokens_seen)
        self.attention = attention
        self.recurrent = recurrent

    @property
    def kind(self) -> str:
        return HYBRID

    def rollback_limit(self, n_tokens: int) -> str | None:
        return self.recurrent.rollback_limit(n_tokens) or self.attention.rollback_limit(n_tokens)

    def truncated(self, n_tokens: int) -> HybridLayerState:
        return HybridLayerState(self.attention.truncated(n_tokens), self.recurrent.truncated(n_tokens))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**self.attention.tensors(), **self.recurrent.tensors()}

    @classmethod
    def from_parts(cls, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> HybridLayerState:
        attention = AttentionLayerState.from_parts(meta, tensors)  # its window: full or sliding attention
        return cls(attention, RecurrentLayerState.from_parts(meta, tensors))

    def to(self, device: torch.device | str) -> HybridLayerState:
        return HybridLayerState(self.attention.to(device), self.recurrent.to(device))


class IndexedLayerState(_WithAttention):
    """Attention K/V plus what dynamic sparse attention (DeepSeek V3.2, GLM MoE DSA) keeps per slot: the
    single-head indexer keys ``[B, S, D_i]`` and, for some models, the indexer positions ``[P, B, S]``.
    Both are None on layers that reuse another layer's indexer; both are cropped with the slots."""

    def __init__(self, attention: AttentionLayerState, indexer_keys: torch.Tensor | None,
                 indexer_positions: torch.Tensor | None = None) -> None:
        super().__init__(attention.tokens_seen)
        self.attention = attention
        self.indexer_keys = indexer_keys
        self.indexer_positions = indexer_positions

    @property
    def kind(self) -> str:
        return INDEXED

    def rollback_limit(self, n_tokens: int) -> str | None:
        return self.attention.rollback_limit(n_tokens)

    def truncated(self, n_tokens: int) -> IndexedLayerState:
        attention = self.attention.truncated(n_tokens)
        S = attention.slots
        keys = None if self.indexer_keys is None or S == 0 else self.indexer_keys[:, :S]
        positions = None if self.indexer_positions is None or S == 0 else self.indexer_positions[..., :S]
        return IndexedLayerState(attention, keys, positions)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = self.attention.tensors()
        if self.indexer_keys is not None:
            out["indexer_keys"] = self.indexer_keys
        if self.indexer_positions is not None:
            out["indexer_positions"] = self.indexer_positions
        return out

    @classmethod
    def from_parts(cls, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> IndexedLayerState:
        return cls(AttentionLayerState.from_parts({**meta, "window": None}, tensors), tensors.get("indexer_keys"),
                   tensors.get("indexer_positions"))

    def to(self, device: torch.device | str) -> IndexedLayerState:
        return IndexedLayerState(self.attention.to(device),
                                 None if self.indexer_keys is None else self.indexer_keys.to(device),
                                 None if self.indexer_positions is None else self.indexer_positions.to(device))


class StatelessLayerState(LayerState):
    """A layer that stores nothing (an MLP-only block, or one that reads another layer's K/V)."""

    @property
    def kind(self) -> str:
        return STATELESS

    def rollback_limit(self, n_tokens: int) -> str | None:
        return None if n_tokens <= self.tokens_seen else f"cannot roll forward to {n_tokens} tokens"

    def truncated(self, n_tokens: int) -> StatelessLayerState:
        return StatelessLayerState(n_tokens)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def meta(self) -> dict[str, object]:
        return {"kind": self.kind, "tokens_seen": self.tokens_seen, "slots": 0, "window": None, "reserve": 0}

    @classmethod
    def from_parts(cls, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> StatelessLayerState:
        return cls(int(meta["tokens_seen"]))  # type: ignore[call-overload]

    def to(self, device: torch.device | str) -> StatelessLayerState:
        return self


def attention_of(layer: LayerState) -> AttentionLayerState | None:
    """The K/V a compression may evict from ``layer``: an attention layer's own, or a hybrid layer's attention
    part (None for every other kind)."""
    if isinstance(layer, AttentionLayerState):
        return layer
    return layer.attention if isinstance(layer, HybridLayerState) else None


def with_attention(layer: LayerState, attention: AttentionLayerState) -> LayerState:
    """``layer`` holding ``attention`` as its K/V (a hybrid layer keeps its recurrent part)."""
    return HybridLayerState(attention, layer.recurrent) if isinstance(layer, HybridLayerState) else attention


# Layer kinds a state file may name, resolved to the class that rebuilds them.
LAYER_KINDS: dict[str, type[LayerState]] = {
    FULL_ATTENTION: AttentionLayerState,
    SLIDING_ATTENTION: AttentionLayerState,
    RECURRENT: RecurrentLayerState,
    HYBRID: HybridLayerState,
    INDEXED: IndexedLayerState,
    STATELESS: StatelessLayerState,
}
