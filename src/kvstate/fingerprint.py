"""Model fingerprints: what a state must match before it may continue on a model.

A fingerprint names the model type and architectures, hashes the config (minus fields
that do not change the computation, such as the attention backend), records the dtype,
and digests **every byte of every parameter and persistent buffer** (what a checkpoint
holds; derived buffers such as RoPE frequencies follow from the config and the code),
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

from ._compat import versions

# Config fields that describe loading or bookkeeping, not the function computed.
_VOLATILE_CONFIG_KEYS = frozenset({
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation", "architectures", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "_commit_hash",
    "quantization_config", "_experts_implementation", "tie_word_embeddings_autoset",
})
_SAMPLE_ELEMENTS = 4096  # per tensor, for the dtype-independent digest
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


def config_json(config: object) -> str:
    """The config's JSON, without volatile fields, recursively (what ``config_hash`` hashes)."""
    return json.dumps(_strip(config.to_dict()), sort_keys=True, default=str)  # type: ignore[attr-defined]


def config_hash(config: object) -> str:
    """SHA-256 over the config's JSON, without volatile fields, recursively."""
    return hashlib.sha256(config_json(config).encode()).hexdigest()


def _strip(value: object) -> object:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _tensors(model: torch.nn.Module, scheme: int = SCHEME) -> list[tuple[str, torch.Tensor]]:
    """Each parameter and buffer once (tied weights share one entry): scheme 3 takes what a checkpoint
    holds (parameters and persistent buffers) in name order; scheme 2 every buffer, in module order."""
    saved = set(model.state_dict(keep_vars=True)) if scheme >= 3 else None
    seen: set[int] = set()
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) not in seen and (saved is None or name in saved):
            seen.add(id(t))
            out.append((name, t))
    return sorted(out, key=lambda item: item[0]) if scheme >= 3 else out


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def weights_digest(model: torch.nn.Module, scheme: int = SCHEME) -> str:
    """SHA-256 over the name, dtype, shape and XXH3-64 of every parameter and buffer."""
    summary = hashlib.sha256()
    for name, t in _tensors(model, scheme):
        summary.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        summary.update(xxhash.xxh3_64_hexdigest(_bytes(t)).encode())
    return summary.hexdigest()


def weights_sample(model: torch.nn.Module, scheme: int = SCHEME) -> str:
    """SHA-256 over strided samples of every tensor, rounded to bfloat16 (equal across dtypes)."""
    h = hashlib.sha256()
    for name, t in _tensors(model, scheme):
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
    """What changes when a weight is replaced or edited in place: identity, storage and version counter.

    Walks the modules' own tables instead of ``named_parameters``: this runs on every verb, and
    the named walk costs ~5x more (0.46 vs 0.10 ms on Gemma-3-270M).
    """
    out = []
    stack, seen = [model], {id(model)}
    while stack:
        module = stack.pop()
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None:
                out.append((id(t), t.data_ptr(), t._version))
        for child in module._modules.values():
            if child is not None and id(child) not in seen:  # shared or cyclic submodules once
                seen.add(id(child))
                stack.append(child)
    return tuple(out)


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
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."), weights_sample=weights_sample(model),
            config_json=config_json(config), transformers=versions.installed())
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
    if state_fp.scheme == 2:
        model_fp = replace(model_fp, weights_digest=weights_digest(model, 2), weights_sample=weights_sample(model, 2),
                           scheme=2)
    return state_fp.differences(model_fp, across_dtypes=cast)


def media_digest(*tensors: torch.Tensor) -> str:
    """SHA-256 of tensors' dtypes, shapes and bytes (an image's pixels and grid)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
