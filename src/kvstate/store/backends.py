"""Where prefix entries live: a local folder (default) or a Redis server (shared by workers).

Both keep whole state files as values, keyed by the chain hash, with LRU eviction
under a byte capacity and shared counters (hits, misses, evictions, bytes).

* Folder: ``<root>/entries/<key[:2]>/<key>.kvs`` written to a temporary name and
  renamed (atomic); eviction and counters run under an ``flock`` on ``<root>/.lock``.
  A write that fails (a full disk, ``EFBIG`` past ``RLIMIT_FSIZE``, Ctrl-C) removes its
  temporary file; one left by a process that died mid-write (``SIGKILL``, a default
  ``SIGXFSZ``) is counted by ``temp_files`` and removed by ``prune`` once it is
  ``STALE_TEMP_SECONDS`` old (a live writer's file is younger: each write touches it).
  A reader holds the whole file in memory once ``get`` returns, and unlinking a
  file never disturbs an open reader, so eviction cannot tear an entry being read.
* Redis: the value, its LRU score and its size change in one Lua script, and
  eviction runs in the same script; ``GET`` returns a whole value or nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import InputFileError, StoreError, StoreWarning, UnsupportedError

COUNTERS = ("hits", "misses", "writes", "evictions", "tokens_reused", "seconds_saved_x1000")


_ENTRY_LIMIT = 1 << 40  # far above any state file; a bound, so no entry is read without one
STALE_TEMP_SECONDS = 15 * 60  # a temporary file untouched this long belongs to no live writer
_TEMP_PATTERNS = ("entries/*/.*.tmp", ".stats.*.tmp", ".probe.*", "entries/.probe.*")  # what writers leave


class FolderBackend:
    """Entries as files in a local folder."""

    def __init__(self, root: str | os.PathLike[str], create: bool = True) -> None:
        self.root = Path(root).expanduser()
        if not create and not (self.root / "entries").is_dir():
            raise StoreError("no prefix store at this folder", expected="a folder a store wrote (it holds entries/)",
                             found=str(self.root), fix="pass the folder kvstate serve or generate --store wrote")
        try:
            (self.root / "entries").mkdir(parents=True, exist_ok=True)
            _probe(self.root)
        except OSError as exc:
            raise StoreError("cannot use this folder as a prefix store", expected="a writable folder",
                             found=f"{self.root}: {exc}", fix="pass a folder you can write to") from exc

    def describe(self) -> str:
        return f"folder {self.root}"

    def _path(self, key: str) -> Path:
        return self.root / "entries" / key[:2] / f"{key}.kvs"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def health(self) -> str:
        """Empty when the folder is usable, else what is wrong."""
        try:
            _probe(self.root / "entries")
            return ""
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}"

    def get(self, key: str) -> bytes | None:
        from ..io.paths import read_bounded

        path = self._path(key)
        # a regular file only, read with a bound: an entry replaced by a FIFO or a link to /dev/zero is a
        # failed read (a StoreWarning and a miss), never a hang or an unbounded read (hostile inputs)
        try:
            data = read_bounded(path, _ENTRY_LIMIT, "prefix store entry")
        except InputFileError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):  # absent, or evicted by another process since
                return None  # (checking first and then opening raced with eviction): a documented miss
            raise
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # the LRU clock (evicted meanwhile: the entry was still read whole)
        return data

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def put(self, key: str, data: bytes, capacity: int | None) -> int:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        with _removed_on_failure(tmp):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        return self.prune(capacity) if capacity is not None else 0

    def temp_files(self) -> list[tuple[Path, int, float]]:
        """``(path, bytes, last change)`` of every temporary file: writes in progress, and those of writers that
        died mid-write."""
        out = []
        for pattern in _TEMP_PATTERNS:
            for path in self.root.glob(pattern):
                with contextlib.suppress(FileNotFoundError):  # renamed or removed meanwhile
                    st = path.stat()
                    out.append((path, st.st_size, st.st_mtime))
        return out

    def remove_stale_temp_files(self, age: float = STALE_TEMP_SECONDS) -> int:
        """Remove the temporary files untouched for ``age`` seconds (no live writer's); returns how many."""
        stale = [path for path, _, changed in self.temp_files() if time.time() - changed > age]
        for path in stale:
            path.unlink(missing_ok=True)
        return len(stale)

    def entries(self) -> list[tuple[str, int, float]]:
        """``(key, bytes, last access)`` of every entry."""
        out = []
        for path in (self.root / "entries").glob("*/*.kvs"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            out.append((path.stem, st.st_size, st.st_mtime))
        return out

    def prune(self, capacity: int) -> int:
        """Evict least recently used entries until at most ``capacity`` bytes remain (and remove stale temporary
        files, which count in no capacity)."""
        self.remove_stale_temp_files()
        with self._locked():
            entries = sorted(self.entries(), key=lambda e: e[2])
            total, evicted = sum(e[1] for e in entries), 0
            for key, size, _ in entries:
                if total <= capacity:
                    break
                self._path(key).unlink(missing_ok=True)
                total, evicted = total - size, evicted + 1
            self._bump_locked({"evictions": evicted})
        return evicted

    def bump(self, counts: dict[str, int]) -> None:
        with self._locked():
            self._bump_locked(counts)

    def _bump_locked(self, counts: dict[str, int]) -> None:
        path = self.root / "stats.json"
        stats = self._read_stats(path)
        for name, n in counts.items():
            stats[name] = stats.get(name, 0) + int(n)
        tmp = path.with_name(f".stats.{os.getpid()}.tmp")
        with _removed_on_failure(tmp):
            tmp.write_text(json.dumps(stats))
            os.replace(tmp, path)

    def counters(self) -> dict[str, int]:
        return self._read_stats(self.root / "stats.json")

    @staticmethod
    def _read_stats(path: Path) -> dict[str, int]:
        """The counters; a damaged file counts as empty and is rewritten at the next bump (with a warning)."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (ValueError, OSError):
            data = None
        if isinstance(data, dict) and all(type(v) is int for v in data.values()):
            return data
        warnings.warn(f"kvstate: prefix store counters in {path} were damaged; starting them again",
                      StoreWarning, stacklevel=4)
        return {}


def _probe(folder: Path) -> None:
    """Create and remove an empty file in ``folder`` (``OSError`` when it cannot be written); a name of its own,
    so two threads probing at once never remove each other's."""
    probe = folder / f".probe.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    with _removed_on_failure(probe):
        probe.write_bytes(b"")
    probe.unlink(missing_ok=True)


@contextmanager
def _removed_on_failure(tmp: Path) -> Iterator[None]:
    """Remove ``tmp`` when the block fails in any way (an ``OSError`` such as ``ENOSPC`` or ``EFBIG``, Ctrl-C):
    a failed write leaves no temporary file behind."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


# Counters are added with ``tonumber(...) or 0``, not HINCRBY: a damaged counter starts again
# at zero instead of making every later call fail.
_ADD = """
local function add(hash, field, n)
  local value = (tonumber(redis.call('HGET', hash, field)) or 0) + n
  redis.call('HSET', hash, field, value)
  return value
end
"""
_EVICT = """
local total = tonumber(redis.call('HGET', KEYS[4], 'bytes')) or 0
local evicted = 0
local capacity = tonumber(ARGV[4])
while capacity >= 0 and total > capacity do
  local oldest = redis.call('ZPOPMIN', KEYS[2])
  if #oldest == 0 then break end
  local size = tonumber(redis.call('HGET', KEYS[3], oldest[1])) or 0
  redis.call('DEL', ARGV[5] .. oldest[1])
  redis.call('HDEL', KEYS[3], oldest[1])
  total = add(KEYS[4], 'bytes', -size)
  evicted = evicted + 1
end
add(KEYS[4], 'evictions', evicted)
return evicted
"""
_PUT = _ADD + """
local old = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], string.len(ARGV[2]))
add(KEYS[4], 'bytes', string.len(ARGV[2]) - (tonumber(old) or 0))
""" + _EVICT
_PRUNE = _ADD + _EVICT
_DELETE = _ADD + """
local size = tonumber(redis.call('HGET', KEYS[3], ARGV[1])) or 0
redis.call('DEL', ARGV[2] .. ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
add(KEYS[4], 'bytes', -size)
"""
_BUMP = _ADD + """
for i = 1, #ARGV, 2 do add(KEYS[1], ARGV[i], tonumber(ARGV[i + 1])) end
"""


class RedisBackend:
    """Entries as values in a Redis server (``redis://host:port/db``)."""

    def __init__(self, url: str, prefix: str = "kvstate:") -> None:
        try:
            import redis
        except ImportError as exc:
            raise UnsupportedError("the Redis backend needs the redis package", found=str(exc),
                                   fix="pip install 'kvstate[redis]'") from exc

        self.url, self.prefix = url, prefix
        try:
            self.client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=10)
        except ValueError as exc:
            raise StoreError("malformed Redis URL", expected="redis://host:port/db, rediss://... or unix://...",
                             found=url, fix="check the URL") from exc
        self._put = self.client.register_script(_PUT)
        self._evict = self.client.register_script(_PRUNE)
        self._bump = self.client.register_script(_BUMP)
        self._evict_one = self.client.register_script(_DELETE)
        self._lru, self._sizes, self._stats = f"{prefix}lru", f"{prefix}sizes", f"{prefix}stats"

    def describe(self) -> str:
        return f"redis {self.url}"

    def get(self, key: str) -> bytes | None:
        data: Any = self.client.get(self.prefix + "entry:" + key)
        if data is not None:
            self.client.zadd(self._lru, {key: time.time()}, xx=True)
        return data

    def contains(self, key: str) -> bool:
        return bool(self.client.exists(self.prefix + "entry:" + key))

    def delete(self, key: str) -> None:
        keys = ["", self._lru, self._sizes, self._stats]
        self._evict_one(keys=keys, args=[key, self.prefix + "entry:"])

    def health(self) -> str:
        """Empty when the server answers, else what is wrong."""
        try:
            self.client.ping()
            return ""
        except Exception as exc:  # any client or connection error: report, never raise
            return f"{type(exc).__name__}: {exc}"

    def put(self, key: str, data: bytes, capacity: int | None) -> int:
        keys = [self.prefix + "entry:" + key, self._lru, self._sizes, self._stats]
        return int(self._put(keys=keys, args=[key, data, time.time(), -1 if capacity is None else capacity,
                                               self.prefix + "entry:"]))

    def entries(self) -> list[tuple[str, int, float]]:
        sizes = {k.decode(): int(v) for k, v in self.client.hgetall(self._sizes).items()}
        scores = {k.decode(): s for k, s in self.client.zrange(self._lru, 0, -1, withscores=True)}
        return [(k, sizes[k], scores.get(k, 0.0)) for k in sizes]

    def temp_files(self) -> list[tuple[Path, int, float]]:
        """None: a Redis write is one script, with nothing temporary to strand."""
        return []

    def prune(self, capacity: int) -> int:
        keys = ["", self._lru, self._sizes, self._stats]
        return int(self._evict(keys=keys, args=["", "", 0, capacity, self.prefix + "entry:"]))

    def bump(self, counts: dict[str, int]) -> None:
        self._bump(keys=[self._stats], args=[x for name, n in counts.items() for x in (name, int(n))])

    def counters(self) -> dict[str, int]:
        out = {}
        for k, v in self.client.hgetall(self._stats).items():
            try:
                out[k.decode()] = int(v)
            except ValueError:  # a damaged counter counts as zero, and the next bump restarts it
                out[k.decode()] = 0
        out.pop("bytes", None)
        return out
