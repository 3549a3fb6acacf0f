"""The self-check's on-disk verdicts: keyed by what the model computes, signed so nobody else can plant one.

A verdict is only as good as the model it was probed on, so its key holds, besides the
architecture (model type, class, layer layout, dtype, transformers and probe versions):

* the model's fingerprint (``kvstate.adapters.fingerprinting``): config hash and a digest of every
  weight, recomputed when a tensor's version counter moves, so a weight edited in place
  is a new key;
* what an in-place edit that is no weight can change: each module's class, its plain
  attributes (``is_causal``, ``training``, ...), its hooks and instance-level methods,
  and the attention implementation.

Each entry is JSON ``{"key", "verdict", "hmac"}``, the HMAC-SHA256 over key and verdict with a
32-byte per-user secret kept beside the entries (``.secret``, created once with ``O_EXCL`` and
mode 0600, published with ``link`` so no reader sees it half written). An entry whose HMAC does
not verify, or made for another key, is ignored: the probe runs again and rewrites it. A secret
that another user owns, that group or others may read or write, or that is not a regular file
disables the cache (every model is probed) rather than trusting or replacing it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path

import torch

_SECRET_NAME = ".secret"
_SECRET_BYTES = 32
_MAX_ENTRY_BYTES = 1 << 16
_PLAIN = (bool, int, float, str, type(None))


def folder() -> Path | None:
    """The cache folder: ``KVSTATE_SELFCHECK_CACHE`` (``off``: none), else the user cache dir."""
    setting = os.environ.get("KVSTATE_SELFCHECK_CACHE")
    if setting == "off":
        return None
    if setting:
        return Path(setting)
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvstate")) / "selfcheck"


def model_key(model: torch.nn.Module, architecture: list[object]) -> str:
    """The JSON key of a verdict: the architecture, the fingerprint and the modules' in-place state."""
    from .adapters.fingerprinting import fingerprint

    fp = fingerprint(model)
    attn = getattr(model.config, "_attn_implementation", None)  # type: ignore[union-attr]
    return json.dumps([*architecture, fp.config_hash, fp.weights_digest, str(attn), modules_digest(model)])


def modules_digest(model: torch.nn.Module) -> str:
    """SHA-256 over each module's name, class, plain attributes, hooks and instance-level callables:
    what a non-weight edit in place (``attention.is_causal = False``, a new forward hook) changes."""
    h = hashlib.sha256()
    for name, module in model.named_modules(remove_duplicate=False):
        attrs = sorted((k, repr(v)) for k, v in vars(module).items() if isinstance(v, _PLAIN))
        calls = sorted((k, _callable_id(v)) for k, v in vars(module).items()
                       if callable(v) and not isinstance(v, torch.nn.Module | type))
        hooks = [_callable_id(f) for table in _hook_tables(module) for f in table.values()]
        h.update(json.dumps([name, type(module).__qualname__, attrs, calls, hooks]).encode())
    return h.hexdigest()


def _hook_tables(module: torch.nn.Module) -> list[dict]:
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_state_dict_hooks")
    return [table for name in names if isinstance(table := getattr(module, name, None), dict)]


def _callable_id(fn: object) -> str:
    """A callable's qualified name and a digest of its bytecode (two lambdas share a name)."""
    target = getattr(fn, "__func__", getattr(fn, "func", fn))
    code = getattr(target, "__code__", None)
    body = hashlib.sha256(code.co_code + repr(code.co_consts).encode()).hexdigest()[:16] if code else ""
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__name__)}:{body}"


def read(key: str) -> dict[str, object] | None:
    """The verdict stored for ``key`` if its HMAC verifies with this user's secret, else None."""
    where, secret = _place(create=False)
    if where is None or secret is None:
        return None
    text = _read_regular(_entry_path(where, key), _MAX_ENTRY_BYTES)
    try:
        entry = json.loads(text) if text is not None else None
        if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("verdict"), dict):
            return None
        good = hmac.compare_digest(str(entry.get("hmac", "")), _sign(secret, key, entry["verdict"]))
    except (ValueError, TypeError, UnicodeDecodeError):
        return None
    return entry["verdict"] if good else None


def write(key: str, verdict: dict[str, object]) -> None:
    """Store a signed verdict; best effort (a cache that cannot be written only costs the next probe)."""
    where, secret = _place(create=True)
    if where is None or secret is None:
        return
    entry = json.dumps({"key": key, "verdict": verdict, "hmac": _sign(secret, key, verdict)})
    path = _entry_path(where, key)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(entry)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _sign(secret: bytes, key: str, verdict: object) -> str:
    message = json.dumps({"key": key, "verdict": verdict}, sort_keys=True).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _entry_path(where: Path, key: str) -> Path:
    return where / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def _place(create: bool) -> tuple[Path | None, bytes | None]:
    """The folder and this user's secret (made on first write when ``create``); None when unusable."""
    where = folder()
    if where is None:
        return None, None
    try:
        if create:
            where.mkdir(mode=0o700, parents=True, exist_ok=True)
        secret = _load_secret(where / _SECRET_NAME)
        if secret is None and create and not os.path.lexists(where / _SECRET_NAME):
            secret = _create_secret(where)
    except OSError:
        return where, None
    return where, secret


def _load_secret(path: Path) -> bytes | None:
    """The secret, only from a regular file this user owns that nobody else may read or write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        private = stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077
        secret = f.read(_SECRET_BYTES + 1) if private else b""
    return secret if len(secret) == _SECRET_BYTES else None


def _create_secret(where: Path) -> bytes | None:
    """Write a new secret under a private name, then link it into place: the first process wins and
    every other one reads the winner's complete file."""
    tmp = where / f".secret.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(_SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, where / _SECRET_NAME)
    finally:
        tmp.unlink()
    return _load_secret(where / _SECRET_NAME)


def _read_regular(path: Path, limit: int) -> str | None:
    """A regular file's text up to ``limit`` bytes, without following a link or blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        data = f.read(limit + 1)
    return data.decode("utf-8", "replace") if len(data) <= limit else None
