"""``State``: everything that decides the next token, as one immutable value.

Shapes (``B`` batch rows, ``T`` token slots processed, ``V`` vocabulary):

* ``tokens`` ``[B, T]`` int64 - processed token ids, padding included;
* ``mask`` ``[B, T]`` bool - False on padding slots;
* ``layers`` - one ``LayerState`` per decoder layer (see ``kvstate.layers``);
* ``next_position`` ``[B]`` int64 - logical (RoPE) position of each row's next token;
* ``last_logits`` ``[B, V]`` - logits at the last processed slot, so a resume whose
  input is already processed needs no re-feed;
* ``extras`` - named model-side tensors (e.g. Qwen-VL ``rope_deltas``);
* ``fingerprint`` - the model the state belongs to;
* ``metadata`` - str -> str notes: the user's, plus ``kvstate.*`` records of lossy
  storage or dtype casts applied on load.

``T`` is *tokens seen*; each layer separately reports *slots stored*. States are
never modified: operations return new states that share unchanged tensors.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from .errors import RollbackError
from .fingerprint import Fingerprint
from .layers import LayerState


@dataclass(frozen=True, eq=False)
class State:
    """Explicit generation state of one conversation batch. See the module docstring."""

    tokens: torch.Tensor
    mask: torch.Tensor
    layers: tuple[LayerState, ...]
    next_position: torch.Tensor
    last_logits: torch.Tensor | None = None
    extras: Mapping[str, torch.Tensor] = field(default_factory=lambda: MappingProxyType({}))
    fingerprint: Fingerprint | None = None
    metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def empty(cls, layers: tuple[LayerState, ...], fingerprint: Fingerprint | None = None,
              batch_size: int = 1, device: torch.device | str = "cpu") -> State:
        """A state that has seen nothing."""
        return cls(tokens=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
                   mask=torch.zeros(batch_size, 0, dtype=torch.bool, device=device),
                   layers=layers,
                   next_position=torch.zeros(batch_size, dtype=torch.long, device=device),
                   fingerprint=fingerprint)

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def tokens_seen(self) -> int:
        """Token slots processed (``T``), padding included."""
        return int(self.tokens.shape[1])

    @property
    def is_empty(self) -> bool:
        return self.tokens_seen == 0

    @property
    def nbytes(self) -> int:
        """Bytes of all layer tensors (K/V and positions)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def kv_dtype(self) -> torch.dtype | None:
        for layer in self.layers:
            keys = layer.tensors().get("keys")
            if keys is not None:
                return keys.dtype
        return None

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def rollback_limit(self, n_tokens: int) -> list[str]:
        """Reasons, one per blocking layer, why the state cannot return to ``n_tokens``."""
        reasons = []
        for i, layer in enumerate(self.layers):
            why = layer.rollback_limit(n_tokens)
            if why is not None:
                reasons.append(f"layer {i}: {why}")
        return reasons

    def truncated(self, n_tokens: int) -> State:
        """The state as it was after the first ``n_tokens`` token slots.

        ``last_logits`` is dropped (it belongs to the longer history), so the next
        call must feed at least one token.
        """
        if not 0 <= n_tokens <= self.tokens_seen:
            raise RollbackError("truncate length out of range", expected=f"0..{self.tokens_seen}",
                                found=n_tokens, fix="pass a length no longer than state.tokens_seen")
        if n_tokens == self.tokens_seen:
            return self
        reasons = self.rollback_limit(n_tokens)
        if reasons:
            raise RollbackError(
                f"cannot roll back from {self.tokens_seen} to {n_tokens} tokens",
                expected="every layer to retain the slots the shorter prefix needs",
                found="; ".join(reasons[:3]) + (" ..." if len(reasons) > 3 else ""),
                fix="create the Session with a larger sliding_reserve, or reset() and re-feed")
        mask = self.mask[:, :n_tokens]
        dropped = self.mask[:, n_tokens:].sum(-1)
        return replace(self, tokens=self.tokens[:, :n_tokens], mask=mask,
                       layers=tuple(layer.truncated(n_tokens) for layer in self.layers),
                       next_position=self.next_position - dropped, last_logits=None)

    def to(self, device: torch.device | str) -> State:
        """A copy with every tensor on ``device``."""
        return replace(
            self, tokens=self.tokens.to(device), mask=self.mask.to(device),
            layers=tuple(layer.to(device) for layer in self.layers),
            next_position=self.next_position.to(device),
            last_logits=None if self.last_logits is None else self.last_logits.to(device),
            extras=MappingProxyType({k: v.to(device) for k, v in self.extras.items()}))

    def save(self, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None,
             compact: str | None = None) -> int:
        """Write this state to one crash-safe file; see ``kvstate.statefile``. Returns bytes."""
        from .files import save_state

        return save_state(self, path, metadata=metadata, compact=compact)

    def summary(self) -> dict[str, object]:
        """JSON-able overview: batch, tokens, per-layer kinds and lengths, bytes."""
        return {
            "batch_size": self.batch_size,
            "tokens_seen": self.tokens_seen,
            "next_position": self.next_position.tolist(),
            "layers": [layer.meta() for layer in self.layers],
            "nbytes": self.nbytes,
            "extras": sorted(self.extras),
            "fingerprint": None if self.fingerprint is None else self.fingerprint.to_dict(),
        }
