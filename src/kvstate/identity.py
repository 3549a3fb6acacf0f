"""The model identity a state carries: a frozen value, compared field by field.

``Fingerprint`` names the model type and architectures, a hash of the config, the dtype,
a digest of every weight and (optionally) the tokenizer's vocabulary. It is pure data:
computing one from a loaded model is ``kvstate.adapters.fingerprinting``'s job, so
``state.py`` can hold a fingerprint without importing torch's model walk or transformers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

# 3: every byte (XXH3-64 per tensor, SHA-256 summary) of the parameters and persistent buffers, in name
# order; 2: the same over every buffer too, in module order, which some models vary between processes
# (5.14's Gemma 3 registers its RoPE buffers from a set) and whose derived, non-persistent buffers move
# between transformers minors (5.24's Qwen3-VL vision RoPE adds original_inv_freq); 1: kvstate 0.1's
# three-tensor sample. Older schemes are checked with their own rules.
SCHEME = 3


@dataclass(frozen=True)
class Fingerprint:
    """Identity of the model a state belongs to."""

    model_type: str
    architectures: tuple[str, ...]
    config_hash: str
    weights_digest: str
    dtype: str
    tokenizer_hash: str | None = None
    weights_sample: str | None = None  # bf16-rounded sample of every tensor: equal across dtypes
    scheme: int = SCHEME
    # the hashed config itself (JSON) and the transformers version that produced it: a state saved under
    # another minor may differ in fields that minor added or moved, never in a field both versions have
    config_json: str | None = None
    transformers: str | None = None

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["architectures"] = list(self.architectures)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Fingerprint:
        text = {k: None if d.get(k) is None else str(d[k])
                for k in ("tokenizer_hash", "weights_sample", "config_json", "transformers")}
        return cls(model_type=str(d["model_type"]),
                   architectures=tuple(str(a) for a in d["architectures"]),  # type: ignore[union-attr]
                   config_hash=str(d["config_hash"]), weights_digest=str(d["weights_digest"]),
                   dtype=str(d["dtype"]), scheme=int(d.get("scheme", 1)), **text)  # type: ignore[call-overload]

    def differences(self, other: Fingerprint, *, across_dtypes: bool = False) -> list[str]:
        """Human-readable fields that differ (tokenizer ignored when either is unknown).

        ``across_dtypes``: the caller cast the state on purpose, so the dtype may differ
        and the weights are compared by their dtype-independent sample.
        """
        skip = {"scheme", "weights_sample", "config_json", "transformers"}
        if across_dtypes:
            skip |= {"dtype", "weights_digest"}
        if self.config_hash != other.config_hash and self.across_versions(other):
            skip.add("config_hash")  # compared field by field instead
        out = [f"config field {c}" for c in self.config_conflicts(other)]
        mine, theirs = self.to_dict(), other.to_dict()
        for name in mine:
            if name in skip or (name == "tokenizer_hash" and None in (mine[name], theirs[name])):
                continue
            if mine[name] != theirs[name]:
                out.append(f"{name}: {mine[name]!r} != {theirs[name]!r}")
        if across_dtypes and self.weights_sample != other.weights_sample:
            out.append(f"weights_sample: {self.weights_sample!r} != {other.weights_sample!r}")
        return out


    def across_versions(self, other: Fingerprint) -> bool:
        """Both record their configs, made under different transformers versions."""
        return None not in (self.config_json, other.config_json, self.transformers, other.transformers) \
            and self.transformers != other.transformers

    def config_conflicts(self, other: Fingerprint) -> list[str]:
        """Fields both configs have, with different values (only across transformers versions; a field one
        minor added or moved is not a conflict, and the weights digest still has to match byte for byte)."""
        if self.config_hash == other.config_hash or not self.across_versions(other):
            return []
        return _conflicts(json.loads(self.config_json or "{}"), json.loads(other.config_json or "{}"), "")


def _conflicts(mine: object, theirs: object, path: str) -> list[str]:
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return [c for k in sorted(set(mine) & set(theirs)) for c in _conflicts(mine[k], theirs[k], f"{path}{k}.")]
    return [] if mine == theirs else [f"{path.rstrip('.')}: {mine!r} != {theirs!r}"]
