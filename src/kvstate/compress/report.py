"""What a compression kept, in K/V entries and in bytes (``Session.compress`` returns it)."""

from __future__ import annotations

from dataclasses import dataclass

from ..layers import attention_of
from ..state import State


@dataclass(frozen=True)
class Compression:
    """One compression's accounting.

    ``entries_*``: K/V entries (slot x KV head x row) the attention layers hold, padding not counted;
    ``window_entries``: of those before, the ones a ratio counts (every slot of a full-attention layer, the
    last ``window - 1`` of a sliding one: what the layer still reads); ``kv_bytes_*``: bytes of keys and
    values held, the padding of per-head layers included; ``padding``: padding entries after;
    ``per_head_layers``: layers whose heads keep their own slots.
    """

    entries_before: int
    entries_after: int
    window_entries: int
    kv_bytes_before: int
    kv_bytes_after: int
    padding: int
    per_head_layers: int

    @property
    def bytes_held(self) -> float:
        """K/V bytes after over K/V bytes before."""
        return self.kv_bytes_after / self.kv_bytes_before if self.kv_bytes_before else 1.0

    @property
    def entries_kept(self) -> float:
        """Entries after over the entries the ratio counts (``window_entries``)."""
        return self.entries_after / self.window_entries if self.window_entries else 1.0

    def to_dict(self) -> dict[str, float | int]:
        return {"entries_before": self.entries_before, "entries_after": self.entries_after,
                "window_entries": self.window_entries, "kv_bytes_before": self.kv_bytes_before,
                "kv_bytes_after": self.kv_bytes_after, "padding": self.padding,
                "per_head_layers": self.per_head_layers, "bytes_held": self.bytes_held,
                "entries_kept": self.entries_kept}


def compression(before: State, after: State) -> Compression:
    """The accounting of ``after``, a compression of ``before``."""
    attention = [part for part in map(attention_of, after.layers) if part is not None and part.keys is not None]
    padding = sum(layer.keys.shape[0] * layer.keys.shape[1] * layer.slots - layer.entries  # type: ignore[union-attr]
                  for layer in attention)
    return Compression(before.kv_entries, after.kv_entries, window_entries(before), before.kv_bytes, after.kv_bytes,
                       padding, sum(layer.per_head for layer in attention))


def window_entries(state: State) -> int:
    """K/V entries the attention layers still read: a sliding layer's last ``window - 1`` slots per head."""
    total = 0
    for layer in map(attention_of, state.layers):
        if layer is not None and layer.keys is not None:
            valid = layer.valid
            width = layer.slots if layer.window is None else min(layer.slots, layer.window - 1)
            B, H = layer.keys.shape[:2]
            total += B * H * width if valid is None else int(valid[..., layer.slots - width:].sum())
    return total
