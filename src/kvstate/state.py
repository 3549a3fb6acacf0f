"""``State``: everything that decides the next token, as one immutable value.

Shapes (``B`` batch rows, ``T`` token slots processed, ``V`` vocabulary):

* ``tokens`` ``[B, T]`` int64 - processed token ids, padding included;
* ``mask`` ``[B, T]`` bool - False on padding slots;
* ``positions`` ``[B, T]`` (or ``[B, T, R]`` for multimodal RoPE, e.g. R = 3 for
  Qwen-VL) int64 - the logical position every processed slot was fed at;
* ``layers`` - one ``LayerState`` per decoder layer (see ``kvstate.layers``);
* ``next_position`` ``[B]`` int64 - logical (RoPE) position of each row's next token;
* ``last_logits`` ``[B, V]`` - logits at the last processed slot, so a resume whose
  input is already processed needs no re-feed;
* ``extras`` - named model-side tensors (e.g. Qwen-VL ``rope_deltas``);
* ``fingerprint`` - the model the state belongs to;
* ``metadata`` - str -> str notes: the user's, plus ``kvstate.*`` records of lossy
  storage or dtype casts applied on load;
* ``media`` - one ``MediaItem`` (slot span and content hash) per image or video whose
  slots the state holds, so a history with the same placeholders but other pixels is
  never continued on stale K/V (media state);
* ``canonical`` / ``canonical_chunk`` / ``canonical_device`` / ``canonical_marks`` - slots
  ``[0, canonical)`` were computed by the canonical schedule with chunks of ``canonical_chunk``
  tokens (and turn marks ``canonical_marks``) on a device of type ``canonical_device``
  (``kvstate.schedule``): a
  resume keeps them up to the schedule's last cut, so a warm answer equals the cold one
  bit for bit (the canonical schedule). Decoded, compressed or cast slots are not canonical.

``T`` is *tokens seen*; each layer separately reports *slots stored*. States are
never modified: operations return new states that share unchanged tensors. The
tensors of a ``State`` are shared with every fork and every later state, so they are
read-only by contract; ``clone()`` gives a private copy. Files: ``kvstate.io``.

``checkpoints`` snapshot the layers that cannot be cropped (recurrent / SSM) at call
boundaries; ``truncated`` uses one to roll such layers back (llama.cpp's context
checkpoints and mlx-lm's segment checkpoints serve the same purpose).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

import torch

from .errors import RollbackError
from .identity import Fingerprint
from .layers import LayerState


@dataclass(frozen=True)
class MediaItem:
    """An image or video the state processed: its placeholder slots ``[start, end)`` and the
    content hash of its pixels and grid (``adapters.fingerprinting.media_digest``)."""

    start: int
    end: int
    digest: str
    kept: bool = True  # False once a compression evicted any of its slots (kvstate.compress.MediaSpans)

    @property
    def key(self) -> tuple[int, int, str]:
        """What identifies the item in a history: its slots and content."""
        return self.start, self.end, self.digest


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """The non-croppable layers (by index) as they were after ``tokens_seen`` slots."""

    tokens_seen: int
    layers: Mapping[int, LayerState]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers.values())


def next_position_after(positions: torch.Tensor, mask: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Each row's next logical position after slots at ``positions`` ``[B, Q(, R)]``.

    One past the largest position of a real slot (M-RoPE jumps after an image), or
    ``before`` ``[B]`` when a row has no real slot among them.
    """
    if positions.shape[1] == 0:
        return before
    flat = positions.amax(-1) if positions.dim() == 3 else positions
    last = flat.masked_fill(~mask, -1).amax(dim=1)
    return torch.where(mask.any(dim=1), last + 1, before)


@dataclass(frozen=True, eq=False)
class State:
    """Explicit generation state of one conversation batch. See the module docstring."""

    tokens: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    layers: tuple[LayerState, ...]
    next_position: torch.Tensor
    last_logits: torch.Tensor | None = None
    extras: Mapping[str, torch.Tensor] = field(default_factory=lambda: MappingProxyType({}))
    fingerprint: Fingerprint | None = None
    metadata: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    checkpoints: tuple[Checkpoint, ...] = ()
    media: tuple[MediaItem, ...] = ()
    canonical: int = 0
    canonical_chunk: int = 0
    canonical_device: str = ""  # "cpu", "cuda", ...: other kernels give other bits
    canonical_marks: tuple[int, ...] = ()  # the schedule's turn marks (kvstate.schedule)

    @classmethod
    def empty(cls, layers: tuple[LayerState, ...], fingerprint: Fingerprint | None = None,
              batch_size: int = 1, device: torch.device | str = "cpu", position_dims: int = 1) -> State:
        """A state that has seen nothing."""
        shape = (batch_size, 0) if position_dims == 1 else (batch_size, 0, position_dims)
        return cls(tokens=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
                   mask=torch.zeros(batch_size, 0, dtype=torch.bool, device=device),
                   positions=torch.zeros(shape, dtype=torch.long, device=device),
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
    def is_compressed(self) -> bool:
        """Some layer evicted slots (``kvstate.compress``): its slots are no longer the history's tail."""
        return any(getattr(layer, "compressed", False) for layer in self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes of all layer tensors (K/V and positions)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the attention layers' keys and values (padding of per-head layers included)."""
        return sum(layer.kv_nbytes for layer in self.layers)

    @property
    def kv_entries(self) -> int:
        """K/V entries (slot x KV head x row) the attention layers hold, padding not counted."""
        return sum(layer.entries for layer in self.layers)

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """dtype of the tensors that follow the model's dtype: K/V, else conv windows (pure SSMs)."""
        for name_matches in (lambda n: n == "keys", lambda n: n.startswith("conv.")):
            for layer in self.layers:
                for name, tensor in layer.tensors().items():
                    if name_matches(name):
                        return tensor.dtype
        return None

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def canonical_for(self, chunk: int, device: str, marks: tuple[int, ...] = ()) -> int:
        """Leading slots computed by the canonical schedule of ``chunk`` tokens and turn ``marks`` on a
        ``device`` type (0 for another schedule or device)."""
        same = chunk > 0 and chunk == self.canonical_chunk and self.canonical_device == device \
            and tuple(marks) == self.canonical_marks
        return self.canonical if same else 0

    def canonical_logits(self, chunk: int, device: str, marks: tuple[int, ...] = ()) -> bool:
        """``last_logits`` are the cold run's for exactly this history: every slot is canonical."""
        return self.last_logits is not None and self.canonical_for(chunk, device, marks) == self.tokens_seen > 0

    def checkpoint_at(self, n_tokens: int) -> Checkpoint | None:
        return next((c for c in self.checkpoints if c.tokens_seen == n_tokens), None)

    def rollback_limit(self, n_tokens: int) -> list[str]:
        """Reasons, one per blocking layer, why the state cannot return to ``n_tokens``."""
        checkpoint = self.checkpoint_at(n_tokens)
        reasons = []
        for i, layer in enumerate(self.layers):
            why = layer.rollback_limit(n_tokens)
            if why is not None and not (checkpoint is not None and i in checkpoint.layers):
                reasons.append(f"layer {i}: {why}")
        if reasons and any(layer.checkpointed for layer in self.layers):
            reasons.append(f"checkpoints exist at {[c.tokens_seen for c in self.checkpoints]}")
        return reasons

    def truncated(self, n_tokens: int) -> State:
        """The state as it was after the first ``n_tokens`` token slots.

        Croppable layers are cut; the others come from the checkpoint at ``n_tokens``.
        ``last_logits`` is dropped (it belongs to the longer history), so the next call
        must feed at least one token.
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
                expected="every layer to retain the slots (or a checkpoint) the shorter prefix needs",
                found=_summary(reasons),
                fix="truncate to a checkpointed length, create the Session with a larger "
                "sliding_reserve, or reset() and re-feed")
        checkpoint = self.checkpoint_at(n_tokens)
        layers = tuple(layer.truncated(n_tokens) if layer.rollback_limit(n_tokens) is None
                       else checkpoint.layers[i]  # type: ignore[union-attr]
                       for i, layer in enumerate(self.layers))
        start = torch.zeros_like(self.next_position)
        return replace(self, tokens=self.tokens[:, :n_tokens], mask=self.mask[:, :n_tokens],
                       positions=self.positions[:, :n_tokens], layers=layers,
                       next_position=next_position_after(self.positions[:, :n_tokens],
                                                         self.mask[:, :n_tokens], start),
                       last_logits=None,
                       checkpoints=tuple(c for c in self.checkpoints if c.tokens_seen <= n_tokens),
                       media=tuple(m for m in self.media if m.end <= n_tokens),
                       canonical=min(self.canonical, n_tokens))

    def with_checkpoint(self, keep: int) -> State:
        """This state plus a snapshot of its non-croppable layers; keeps the newest ``keep``."""
        layers = {i: layer for i, layer in enumerate(self.layers) if layer.checkpointed}
        if not layers or keep <= 0 or self.checkpoint_at(self.tokens_seen) is not None:
            return self
        checkpoints = (*self.checkpoints, Checkpoint(self.tokens_seen, MappingProxyType(layers)))
        return replace(self, checkpoints=checkpoints[-keep:])

    def with_media(self, start: State, media: tuple[MediaItem, ...] | None) -> State:
        """This state, which continued ``start``, recording the items of ``media`` it processed."""
        new = tuple(m for m in media or () if m.start >= start.tokens_seen and m.end <= self.tokens_seen)
        return replace(self, media=(*start.media, *new)) if new else self

    def clone(self) -> State:
        """A deep copy that shares no tensor memory with this state."""
        return self._map(lambda t: t.clone())

    def to(self, device: torch.device | str) -> State:
        """A copy with every tensor on ``device``."""
        return self._map(lambda t: t.to(device))

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> State:
        """This state with ``fn`` applied to every tensor (layers, checkpoints, logits, extras)."""
        def layer(x: LayerState) -> LayerState:
            return type(x).from_parts(x.meta(), {k: fn(v) for k, v in x.tensors().items()})

        return replace(
            self, tokens=fn(self.tokens), mask=fn(self.mask), positions=fn(self.positions),
            layers=tuple(layer(x) for x in self.layers),
            checkpoints=tuple(Checkpoint(c.tokens_seen, MappingProxyType({i: layer(x) for i, x in c.layers.items()}))
                              for c in self.checkpoints),
            next_position=fn(self.next_position),
            last_logits=None if self.last_logits is None else fn(self.last_logits),
            extras=MappingProxyType({k: fn(v) for k, v in self.extras.items()}))

    def summary(self) -> dict[str, object]:
        """JSON-able overview: batch, tokens, per-layer kinds and lengths, bytes."""
        return {
            "batch_size": self.batch_size,
            "tokens_seen": self.tokens_seen,
            "next_position": self.next_position.tolist(),
            "layers": [layer.meta() for layer in self.layers],
            "nbytes": self.nbytes,
            "kv_bytes": self.kv_bytes,
            "kv_entries": self.kv_entries,
            "checkpoints": [c.tokens_seen for c in self.checkpoints],
            "checkpoint_nbytes": sum(c.nbytes for c in self.checkpoints),
            "extras": sorted(self.extras),
            "media": [[m.start, m.end, m.digest, m.kept] for m in self.media],
            "canonical": [self.canonical, self.canonical_chunk, self.canonical_device, list(self.canonical_marks)],
            "fingerprint": None if self.fingerprint is None else self.fingerprint.to_dict(),
        }


def _summary(reasons: list[str]) -> str:
    """The first three layer reasons, how many more, and the checkpoint list (the clue for the fix)."""
    layers = [r for r in reasons if r.startswith("layer ")]
    rest = [r for r in reasons if not r.startswith("layer ")]
    more = [f"and {len(layers) - 3} more layers"] if len(layers) > 3 else []
    return "; ".join(layers[:3] + more + rest)
