"""Model fingerprints: what a state must match before it may continue on a model.

A fingerprint names the model type and architectures, hashes the config (minus fields
that do not change the computation, such as the attention backend), records the dtype,
and digests **every byte of every parameter and buffer** the model computes with,
adapter weights (peft LoRA, say) included when they are part of the module tree. The
bulk is hashed with XXH3-64 (fast, non-cryptographic); SHA-256 covers the summary.
A copy differing in one layer's weights therefore gets another fingerprint.

The digest is computed once per model instance and cached. Before every use, a key of
each tensor's identity, storage and version counter (bumped by every in-place edit
through the tensor) is compared with the cached one, and the digest is recomputed when
it moved: weights edited after a session was built are noticed. An edit through
``param.data`` bypasses version counters; call ``fingerprint(model, refresh=True)``
after one.

A second, dtype-independent digest (a bf16-rounded sample of every tensor) lets a state
saved in one dtype load into the same weights in another, when the caller opts in to
the cast. Fingerprints of kvstate 0.1 (a sample of three tensors) are recognised and
checked with their own scheme. Python's ``hash()`` is never used.
"""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from dataclasses import asdict, dataclass, replace

import torch
import xxhash

# Config fields that describe loading or bookkeeping, not the function computed.
_VOLATILE_CONFIG_KEYS = frozenset({
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation", "architectures", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "_commit_hash",
    "quantization_config", "_experts_implementation", "tie_word_embeddings_autoset",
})
_SAMPLE_ELEMENTS = 4096  # per tensor, for the dtype-independent digest
SCHEME = 2  # 2: every byte (XXH3-64 per tensor, SHA-256 summary); 1: kvstate 0.1's three-tensor sample


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

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["architectures"] = list(self.architectures)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Fingerprint:
        text = {k: None if d.get(k) is None else str(d[k]) for k in ("tokenizer_hash", "weights_sample")}
        return cls(model_type=str(d["model_type"]),
                   architectures=tuple(str(a) for a in d["architectures"]),  # type: ignore[union-attr]
                   config_hash=str(d["config_hash"]), weights_digest=str(d["weights_digest"]),
                   dtype=str(d["dtype"]), scheme=int(d.get("scheme", 1)), **text)  # type: ignore[call-overload]

    def differences(self, other: Fingerprint, *, across_dtypes: bool = False) -> list[str]:
        """Human-readable fields that differ (tokenizer ignored when either is unknown).

        ``across_dtypes``: the caller cast the state on purpose, so the dtype may differ
        and the weights are compared by their dtype-independent sample.
        """
        skip = {"scheme", "weights_sample"}
        if across_dtypes:
            skip |= {"dtype", "weights_digest"}
        out = []
        mine, theirs = self.to_dict(), other.to_dict()
        for name in mine:
            if name in skip or (name == "tokenizer_hash" and None in (mine[name], theirs[name])):
                continue
            if mine[name] != theirs[name]:
                out.append(f"{name}: {mine[name]!r} != {theirs[name]!r}")
        if across_dtypes and self.weights_sample != other.weights_sample:
            out.append(f"weights_sample: {self.weights_sample!r} != {other.weights_sample!r}")
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


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer, each once (tied weights share one entry)."""
    seen: set[int] = set()
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over the name, dtype, shape and XXH3-64 of every parameter and buffer."""
    summary = hashlib.sha256()
    for name, t in _tensors(model):
        summary.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        summary.update(xxhash.xxh3_64_hexdigest(_bytes(t)).encode())
    return summary.hexdigest()


def weights_sample(model: torch.nn.Module) -> str:
    """SHA-256 over strided samples of every tensor, rounded to bfloat16 (equal across dtypes)."""
    h = hashlib.sha256()
    for name, t in _tensors(model):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // _SAMPLE_ELEMENTS)
        sample = flat[::step][:_SAMPLE_ELEMENTS].to("cpu", torch.bfloat16).contiguous()
        h.update(name.encode())
        h.update(sample.view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def legacy_weights_digest(model: torch.nn.Module) -> str:
    """kvstate 0.1's digest (scheme 1): strided samples of the first, middle and last parameters."""
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


def weights_key(model: torch.nn.Module) -> tuple:
    """What changes when a weight is replaced or edited in place: identity, storage and version counter."""
    return tuple((id(t), t.data_ptr(), t._version) for _, t in _tensors(model))


_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, Fingerprint]] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def fingerprint(model: torch.nn.Module, tokenizer: object | None = None, *, refresh: bool = False) -> Fingerprint:
    """Fingerprint of a loaded transformers model (and optionally its tokenizer); cached per model."""
    key = weights_key(model)
    with _CACHE_LOCK:
        cached = _CACHE.get(model)
    if refresh or cached is None or cached[0] != key:
        config = model.config  # type: ignore[attr-defined]
        base = Fingerprint(
            model_type=str(config.model_type),
            architectures=tuple(getattr(config, "architectures", None) or (type(model).__name__,)),
            config_hash=config_hash(config), weights_digest=weights_digest(model),
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."), weights_sample=weights_sample(model))
        with _CACHE_LOCK:
            _CACHE[model] = (key, base)
    else:
        base = cached[1]
    return base if tokenizer is None else replace(base, tokenizer_hash=tokenizer_hash(tokenizer))


def mismatch(state_fp: Fingerprint, model: torch.nn.Module, model_fp: Fingerprint, *, cast: bool) -> list[str]:
    """Why a state made with ``state_fp`` may not continue on ``model`` (empty: it may).

    ``cast``: the state's dtype was converted on purpose, so weights are compared by
    their dtype-independent sample. A kvstate 0.1 fingerprint is checked with its scheme.
    """
    if state_fp.scheme == 1:
        model_fp = replace(model_fp, weights_digest=legacy_weights_digest(model), weights_sample=None, scheme=1)
        return state_fp.differences(model_fp, across_dtypes=False)
    return state_fp.differences(model_fp, across_dtypes=cast)


def media_digest(*tensors: torch.Tensor) -> str:
    """SHA-256 of tensors' dtypes, shapes and bytes (an image's pixels and grid)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
