"""Model fingerprints: what a state must match before it may continue on a model.

A fingerprint names the model type and architectures, hashes the config (minus
fields that do not change the computation, such as the attention backend), digests
a strided sample of a few named weight tensors, and records the dtype. Two
instances built from the same weights agree; two random initialisations of the same
config do not. All hashes are SHA-256, never Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

# Config fields that describe loading or bookkeeping, not the function computed.
_VOLATILE_CONFIG_KEYS = frozenset({
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation", "architectures", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "_commit_hash",
    "quantization_config", "_experts_implementation", "tie_word_embeddings_autoset",
})
_SAMPLE_ELEMENTS = 4096


@dataclass(frozen=True)
class Fingerprint:
    """Identity of the model a state belongs to."""

    model_type: str
    architectures: tuple[str, ...]
    config_hash: str
    weights_digest: str
    dtype: str
    tokenizer_hash: str | None = None

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["architectures"] = list(self.architectures)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Fingerprint:
        return cls(model_type=str(d["model_type"]),
                   architectures=tuple(str(a) for a in d["architectures"]),  # type: ignore[union-attr]
                   config_hash=str(d["config_hash"]), weights_digest=str(d["weights_digest"]),
                   dtype=str(d["dtype"]),
                   tokenizer_hash=None if d.get("tokenizer_hash") is None else str(d["tokenizer_hash"]))

    def differences(self, other: Fingerprint) -> list[str]:
        """Human-readable fields that differ (tokenizer ignored when either is unknown)."""
        out = []
        for name, mine in self.to_dict().items():
            theirs = other.to_dict()[name]
            if name == "tokenizer_hash" and (mine is None or theirs is None):
                continue
            if mine != theirs:
                out.append(f"{name}: {mine!r} != {theirs!r}")
        return out


def config_hash(config: object) -> str:
    """SHA-256 over the config's JSON, without volatile fields, recursively."""
    data = config.to_dict()  # type: ignore[attr-defined]
    return hashlib.sha256(json.dumps(_strip(data), sort_keys=True, default=str).encode()).hexdigest()


def _strip(value: object) -> object:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over strided samples of the first, middle and last named parameters.

    Samples are rounded to bfloat16 first, so the same weights loaded in fp32 or bf16
    agree (what a state loaded with an explicit dtype cast relies on).
    """
    named = list(model.named_parameters())
    picks = sorted({0, len(named) // 2, len(named) - 1}) if named else []
    h = hashlib.sha256()
    for i in picks:
        name, param = named[i]
        flat = param.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLE_ELEMENTS)
        sample = flat[::step][:_SAMPLE_ELEMENTS].to("cpu", torch.bfloat16).contiguous()
        h.update(name.encode())
        h.update(sample.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def tokenizer_hash(tokenizer: object) -> str:
    """SHA-256 of the tokenizer's vocabulary (token → id), sorted."""
    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    blob = json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def fingerprint(model: torch.nn.Module, tokenizer: object | None = None) -> Fingerprint:
    """Fingerprint of a loaded transformers model (and optionally its tokenizer)."""
    config = model.config  # type: ignore[attr-defined]
    dtype = next(model.parameters()).dtype
    return Fingerprint(
        model_type=str(config.model_type),
        architectures=tuple(getattr(config, "architectures", None) or (type(model).__name__,)),
        config_hash=config_hash(config),
        weights_digest=weights_digest(model),
        dtype=str(dtype).removeprefix("torch."),
        tokenizer_hash=None if tokenizer is None else tokenizer_hash(tokenizer),
    )


def media_digest(*tensors: torch.Tensor) -> str:
    """SHA-256 of tensors' dtypes, shapes and bytes (an image's pixels and grid)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
