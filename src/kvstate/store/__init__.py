"""``PrefixStore``: reuse the longest stored prefix across requests, processes and machines.

A ``Session(model, store=PrefixStore(...))`` looks up, on every ``generate``, the
longest chunk-aligned prefix of the requested history that any session of the same
model, dtype and namespace has stored, loads it, and feeds only the rest. After
each call it writes back chunk-aligned prefixes, by the ``write`` policy:

* ``"turns"`` (default): the longest aligned prefix of each state offered. A session
  offers two per call: the history it was asked to continue (so the same prompt, or
  one sharing its start, hits next time) and the conversation after the answer;
* ``"all"``: every aligned prefix not stored yet;
* an integer ``N``: aligned prefixes at multiples of ``N`` tokens.

Entries are whole state files (validated on load like any state file). Recurrent
layers are reusable only where a checkpoint exists, so a store-backed session
checkpoints every chunk. Compressed states are keyed apart from uncompressed ones.
The store serves single-row conversations; batched sessions bypass it.

A store is a cache: when its backend fails (a full disk, a Redis that went away),
``lookup`` answers a miss and ``offer`` writes nothing, each with a ``StoreWarning``
and a count in ``stats()["failures"]``. A damaged entry is a miss and is removed; damaged
counters start again. A failed folder write leaves no temporary file; one stranded by a
process that died mid-write is counted by ``stats()["temp_files"]`` and removed by ``prune``.
An unusable folder or a malformed URL raises ``StoreError`` when the store is created. ``health()`` says
whether the backend answers now. The store sees states and ``PrefixQuery`` values (``kvstate.protocols``),
never a session.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError, StateFileError, StoreError, StoreWarning
from ..identity import Fingerprint
from ..io import state_from_bytes, state_to_bytes
from ..protocols import PrefixQuery
from ..state import State
from .backends import COUNTERS, STALE_TEMP_SECONDS, FolderBackend, RedisBackend
from .keys import chain, salt

__all__ = ["FolderBackend", "PrefixStore", "RedisBackend", "StoreWarning"]


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def backend_for(location: str | os.PathLike[str], create: bool = True) -> FolderBackend | RedisBackend:
    """A Redis backend for a Redis URL, a folder backend for a path (``create=False``: only a folder a store
    already wrote); any other URL (``ftp://x``, ``s3://b``) is refused rather than taken for a folder named
    ``ftp:``."""
    text = str(location)
    if text.startswith(REDIS_SCHEMES):
        return RedisBackend(text)
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", text)
    if scheme:
        raise StoreError("unsupported prefix-store URL", expected="a folder path or redis://host:port/db "
                         "(rediss://..., unix://...)", found=text,
                         fix=f"use a folder or a Redis server; {scheme.group(1)}:// stores are not supported")
    return FolderBackend(Path(text), create)


class PrefixStore:
    """A prefix cache of state files in a folder (default) or Redis (``redis://...``). ``create=False`` opens only
    a folder a store already wrote (``StoreError`` otherwise), for tools that only read or prune one."""

    name = "store"  # what ResumePlan.source calls a hit

    def __init__(self, location: str | os.PathLike[str], *, chunk_tokens: int = 64, namespace: str = "default",
                 capacity_bytes: int | None = None, write: str | int = "turns", create: bool = True) -> None:
        if chunk_tokens < 1 or (capacity_bytes is not None and capacity_bytes < 0):
            raise InputError("invalid store settings", expected="chunk_tokens >= 1, capacity_bytes >= 0",
                             found={"chunk_tokens": chunk_tokens, "capacity_bytes": capacity_bytes})
        if write not in ("turns", "all") and not (isinstance(write, int) and write > 0):
            raise InputError("invalid write policy", expected="'turns', 'all' or a positive int", found=write)
        self.backend = backend_for(location, create)
        self.chunk_tokens, self.namespace = chunk_tokens, namespace
        self.capacity_bytes, self.write = capacity_bytes, write
        self.failures = 0  # backend failures in this process (reads answered as misses, writes skipped)

    # ----- keys --------------------------------------------------------------------------
    def keys(self, fingerprint: Fingerprint, tokens: torch.Tensor, media: tuple[tuple[int, str], ...],
             compressed: bool) -> list[str]:
        """Chain keys of every full chunk of ``tokens`` ``[1, L]``."""
        return chain(salt(fingerprint, self.namespace, compressed), tokens[0], self.chunk_tokens, list(media))

    # ----- lookup and write-back (the StateSource / StateSink protocols) -----------------------
    def lookup(self, query: PrefixQuery, *, longer_than: int, at_most: int) -> State | None:
        """The longest stored prefix state with ``longer_than < length <= at_most`` tokens, or None."""
        try:
            return self._lookup(query, longer_than, at_most)
        except Exception as exc:  # a cache that cannot be read is a miss
            self._failed("read", exc)
            return None

    def offer(self, states: Sequence[State], query: PrefixQuery, seconds_per_token: float = 0.0) -> int:
        """Write the aligned prefixes of ``states`` the policy asks for; returns how many were written."""
        try:
            return sum(self._offer(state, query, seconds_per_token) for state in states)
        except Exception as exc:  # the caller's answer never depends on the cache
            self._failed("write", exc)
            return 0

    def _failed(self, what: str, exc: Exception) -> None:
        self.failures += 1
        warnings.warn(f"kvstate: prefix store {what} failed ({self.backend.describe()}), continuing without it: "
                      f"{type(exc).__name__}: {exc}", StoreWarning, stacklevel=4)

    def _lookup(self, query: PrefixQuery, longer_than: int, at_most: int) -> State | None:
        keys = self.keys(query.fingerprint, query.tokens, query.media, compressed=False)
        for i in range(len(keys) - 1, -1, -1):
            n = (i + 1) * self.chunk_tokens
            if n > at_most:
                continue
            if n <= longer_than:
                break
            state = self._load(keys[i], query.tokens[:, :n])
            if state is not None:
                cost = float(state.metadata.get("kvstate.prefill_seconds_per_token", 0.0))
                self.backend.bump({"hits": 1, "tokens_reused": n, "seconds_saved_x1000": int(n * cost * 1000)})
                return state
        self.backend.bump({"misses": 1})
        return None

    def _load(self, key: str, prefix: torch.Tensor) -> State | None:
        data = self.backend.get(key)
        if data is None:
            return None
        try:
            state = state_from_bytes(data, f"store entry {key}")
        except StateFileError as exc:  # a damaged entry is a miss, never a wrong answer; and it goes
            self.backend.delete(key)
            warnings.warn(f"kvstate: removed a damaged prefix store entry {key[:16]}: {exc}", StoreWarning,
                          stacklevel=5)
            return None
        if not torch.equal(state.tokens.cpu(), prefix.cpu()):
            return None  # belt and braces against key collisions
        return state

    def _offer(self, state: State, query: PrefixQuery, seconds_per_token: float) -> int:
        if state.batch_size != 1 or not bool(state.mask.all()):
            return 0
        compressed = any(getattr(layer, "compressed", False) for layer in state.layers)
        keys = self.keys(query.fingerprint, state.tokens, query.media, compressed)
        written = 0
        for i in self._boundaries(len(keys), state.tokens_seen):
            n = (i + 1) * self.chunk_tokens
            if self.backend.contains(keys[i]) or state.rollback_limit(n):
                continue
            if state.canonical_chunk and n > state.canonical:  # decoded slots: a hit would feed them again
                continue
            cost = {"kvstate.prefill_seconds_per_token": f"{seconds_per_token:.6g}"}
            self.backend.put(keys[i], state_to_bytes(state.truncated(n), metadata=cost), self.capacity_bytes)
            written += 1
        if written:
            self.backend.bump({"writes": written})
        return written

    def _boundaries(self, n_chunks: int, tokens: int) -> list[int]:
        if n_chunks == 0:
            return []
        if self.write == "turns":
            # the longest aligned prefix serves a longer request; the same request again feeds at least one
            # token, so it needs the longest prefix shorter than itself (the same one unless the state is aligned)
            return sorted({n_chunks - 1, (tokens - 1) // self.chunk_tokens - 1} - {-1})
        if self.write == "all":
            return list(range(n_chunks))
        step = max(1, int(self.write) // self.chunk_tokens)
        return [i for i in range(n_chunks) if ((i + 1) % step) == 0]

    # ----- administration ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Entries, bytes, counters shared by every user of the store, and this process's failures."""
        try:
            entries = self.backend.entries()
            counters = {name: 0 for name in COUNTERS} | self.backend.counters()
            temps = self.backend.temp_files()
        except Exception as exc:  # unreachable backend: one typed error, not a client traceback
            raise StoreError("prefix store unreachable", found=f"{self.backend.describe()}: {exc}",
                             fix="check that the folder exists or the Redis server runs (store.health())") from exc
        saved = counters.pop("seconds_saved_x1000") / 1000
        stale = [t for t in temps if time.time() - t[2] > STALE_TEMP_SECONDS]
        return {"backend": self.backend.describe(), "entries": len(entries), "bytes": sum(e[1] for e in entries),
                "capacity_bytes": self.capacity_bytes, **counters, "estimated_prefill_seconds_saved": saved,
                "failures": self.failures, "temp_files": len(temps), "temp_bytes": sum(t[1] for t in temps),
                "stale_temp_files": len(stale)}

    def ls(self) -> list[dict[str, Any]]:
        return [{"key": k, "bytes": b, "last_access": t} for k, b, t in sorted(self.backend.entries(),
                                                                             key=lambda e: -e[2])]

    def prune(self, max_bytes: int) -> int:
        """Evict least recently used entries down to ``max_bytes``, and remove temporary files that writers which
        died mid-write left (``STALE_TEMP_SECONDS`` old: a live writer's are younger); returns entries evicted."""
        return self.backend.prune(max_bytes)

    def health(self) -> dict[str, Any]:
        """Whether the backend answers now, and how many calls it failed in this process."""
        problem = self.backend.health()
        return {"backend": self.backend.describe(), "ok": not problem, "problem": problem or None,
                "failures": self.failures}
