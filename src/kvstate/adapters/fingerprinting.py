"""Fingerprinting a loaded model: what a state must match before it may continue on it.

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
after one. Inside ``unchanged(model)`` (a run of verbs on one thread that cannot edit the weights
between them: ``kvstate.batch``'s step between two of its events) the key is taken once.

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import xxhash

from .._compat import versions
from ..identity import SCHEME, Fingerprint

# Config fields that describe loading or bookkeeping, not the function computed.
_VOLATILE_CONFIG_KEYS = frozenset({
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation", "architectures", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "_commit_hash",
    "quantization_config", "_experts_implementation", "tie_word_embeddings_autoset",
})
_SAMPLE_ELEMENTS = 4096  # per tensor, for the dtype-independent digest


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
    """SHA-256 of the tokenizer's vocabulary (token → id), sorted.

    Kept per tokenizer object while its length (vocabulary plus added tokens) stays the same: a large
    vocabulary's hash would otherwise be paid by every ``Session`` made with that tokenizer. Adding tokens
    changes the length, so the hash is taken again; transformers has no verb that edits an entry in place."""
    try:
        size = len(tokenizer)  # type: ignore[arg-type]
        with _CACHE_LOCK:
            kept = _TOKENIZERS.get(tokenizer)
    except TypeError:  # no length, or neither hashable nor weakly referable: not kept
        size, kept = None, None
    if kept is not None and kept[0] == size:
        return kept[1]
    vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()
    if size is not None:
        with _CACHE_LOCK:
            _TOKENIZERS[tokenizer] = (size, digest)  # get() above showed the tokenizer can be a weak key
    return digest


def weights_key(model: torch.nn.Module) -> tuple:
    """What changes when a weight is replaced or edited in place: identity, storage and version counter.

    Walks the modules' own tables instead of ``named_parameters``: this runs on every verb, and
    the named walk costs several times more (docs/benchmarks.md).
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


_UNCHANGED = threading.local()  # keys: {id(model): (model, weights_key)} inside ``unchanged`` on this thread


@contextmanager
def unchanged(model: torch.nn.Module) -> Iterator[None]:
    """Inside, on this thread, ``fingerprint(model)`` walks ``model``'s tensors once: for a run of kvstate verbs
    that cannot edit the weights between them (a scheduler step admitting many prompts runs three verbs for
    each)."""
    if getattr(_UNCHANGED, "keys", None) is not None:  # nested: the outer scope's key holds
        yield
        return
    _UNCHANGED.keys = {}
    try:
        yield
    finally:
        _UNCHANGED.keys = None


def _key(model: torch.nn.Module) -> tuple:
    keys = getattr(_UNCHANGED, "keys", None)
    if keys is None:
        return weights_key(model)
    found = keys.get(id(model))
    if found is None or found[0] is not model:
        found = keys[id(model)] = (model, weights_key(model))
    return found[1]


_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, Fingerprint]] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()
_TOKENIZERS: weakref.WeakKeyDictionary[object, tuple[int, str]] = weakref.WeakKeyDictionary()  # tokenizer_hash's


def fingerprint(model: torch.nn.Module, tokenizer: object | None = None, *, refresh: bool = False) -> Fingerprint:
    """Fingerprint of a loaded transformers model (and optionally its tokenizer); cached per model."""
    key = _key(model)
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
