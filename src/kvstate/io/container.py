"""State files: one safetensors file per ``State``, crash-safe and safe to load.

Layout (plain safetensors, readable by ``safetensors.safe_open``)::

    u64 little-endian N | N bytes JSON header | tensor bytes

The JSON header maps tensor names to ``{dtype, shape, data_offsets}`` and carries
``__metadata__["kvstate"]``, a JSON string with kvstate's own versioned header (see
``kvstate.io.schema``), which includes a checksum of every tensor (XXH3-64 from format
version 2, CRC-32 in version 1).

Loading never unpickles, never trusts a size it has not checked against the file, and
turns every defect into ``StateFileError``, as safetensors' and llama.cpp's loaders do:
only regular files are opened (a FIFO, a device or a folder is refused before it can
block or stream forever); the 8-byte header length is read first and capped; the header
JSON rejects duplicate keys and non-finite numbers; every tensor must lie inside the
file, its byte range must equal its shape, regions tile the data exactly; and only then
is memory allocated, once, for the data. The data is read once, straight into that memory
(the tensors view it), in pieces each hashed while still in cache. A load costs about the
file size in memory and time proportional to it. Saving writes a temporary file in the
target folder (tensors first, hashed meanwhile on kvstate's I/O thread; the header with
their checksums last), fsyncs it, then renames it over the target, so a crash leaves the
previous file intact; the replaced file's blocks are freed on the I/O thread. What a save may
replace (regular files only; a symlink is written through) is decided in ``paths``.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import struct
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import StateFileError
from .checksum import CHECKSUMS, new_hasher, run_beside, tensor_bytes
from .memory import check_memory, prefer_huge_pages
from .paths import clean_leftovers, recheck, save_target, temp_name

MAX_HEADER_BYTES = 64 * 2**20  # generous for token lists; bounds what a hostile file can make us parse
CHUNK = 2**20  # read and hash in pieces that stay in the core's cache (2 MiB L2 here)
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_ITEMSIZE = {k: torch.empty(0, dtype=v).element_size() for k, v in _DTYPES.items()}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (already checked by the layout validation)."""
    return _DTYPES[name]


def _seed(tensor_or_entry: torch.Tensor | tuple[str, list[int]]) -> str:
    """What binds a checksum to a tensor's dtype and shape, so a header edit that
    reinterprets intact bytes is caught too."""
    if isinstance(tensor_or_entry, torch.Tensor):
        return f"{_NAMES[tensor_or_entry.dtype]}{list(tensor_or_entry.shape)}"
    return f"{tensor_or_entry[0]}{tensor_or_entry[1]}"


def digest(tensor: torch.Tensor, algorithm: str = "xxh3-64") -> str:
    """Checksum of a tensor's dtype, shape and bytes, as hex (integrity, not authentication)."""
    return _digest_of(tensor, tensor_bytes(tensor), algorithm)


def _digest_of(tensor: torch.Tensor, blob: memoryview, algorithm: str = "xxh3-64") -> str:
    hasher = new_hasher(algorithm, _seed(tensor))
    hasher.update(blob)
    return hasher.hexdigest()


def header_crc(header: dict) -> str:
    """CRC-32 of the kvstate header in canonical JSON, without its own ``header_crc`` field."""
    body = {k: v for k, v in header.items() if k != "header_crc"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


def write(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], header: dict) -> int:
    """Atomically write ``tensors`` plus the kvstate ``header`` (JSON-able) to ``path``.

    Checksums are added unless ``header`` brings its own (``checksums``); they are computed on
    kvstate's I/O thread while this one writes (a hex digest has a fixed width, so the header's
    size is known before its digests are), and the header goes in last, before the fsync.
    """
    path = save_target(path)  # a symlink's regular target; devices, FIFOs and folders are refused
    ordered, blobs = _blobs(tensors)
    given = "checksums" in header  # tests and old-format writers bring their own
    planned = header if given else {**header, "checksum": "xxh3-64", "checksums": dict.fromkeys(ordered, "0" * 16)}
    raw = _header_bytes(ordered, blobs, planned)
    tmp = temp_name(path, "tmp")
    old = None
    try:
        with open(tmp, "xb") as f:  # a fresh name: never follows a link planted there
            sums = None if given else run_beside(_digests, ordered, blobs)
            f.seek(len(raw))
            for blob in blobs:
                f.write(blob)
            if sums is not None:
                raw = _same_size(raw, _header_bytes(ordered, blobs, {**planned, "checksums": sums.result()}))
            f.seek(0)
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        recheck(path)
        old = _keep_replaced(path)
        os.replace(tmp, path)
    except BaseException as exc:
        for leftover in (tmp, old):
            if leftover is not None:
                _discard(leftover)
        if isinstance(exc, OSError):
            raise StateFileError("cannot write state file", found=f"{path}: {exc}",
                                 fix="check the free space and the folder's permissions") from exc
        raise
    _fsync_dir(path.parent)
    clean_leftovers(path)  # what killed saves to this file left behind
    if old is not None:
        run_beside(_discard, old)
    return len(raw) + sum(blob.nbytes for blob in blobs)


def _same_size(planned: bytes, final: bytes) -> bytes:
    if len(final) != len(planned):  # digests are fixed-width hex: cannot happen unless that changes
        raise RuntimeError(f"kvstate bug: header size changed from {len(planned)} to {len(final)} bytes")
    return final


def _keep_replaced(path: Path) -> Path | None:
    """A second name for the file ``path`` is about to replace, so that the rename does not free its
    blocks while the caller waits (docs/benchmarks.md); ``_discard`` frees them on kvstate's I/O
    thread. A crash in between leaves a ``.<name>.<pid>.<id>.old`` file beside it."""
    if not path.is_file():
        return None
    old = temp_name(path, "old")
    try:
        os.link(path, old)
    except OSError:  # no hard links here: the rename frees the blocks itself
        return None
    return old


def _discard(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _digests(ordered: Mapping[str, torch.Tensor], blobs: list[memoryview]) -> dict[str, str]:
    return {name: _digest_of(t, blob) for (name, t), blob in zip(ordered.items(), blobs, strict=True)}


def to_bytes(tensors: Mapping[str, torch.Tensor], header: dict) -> bytes:
    """The whole file as bytes (for stores that keep values, not files); checksums as in ``write``."""
    ordered, blobs = _blobs(tensors)
    if "checksums" not in header:
        header = {**header, "checksum": "xxh3-64", "checksums": _digests(ordered, blobs)}
    return b"".join([_header_bytes(ordered, blobs, header), *blobs])


def _blobs(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[memoryview]]:
    """The tensors in file order (widest elements first keeps every one aligned for zero-copy loading)
    and their bytes."""
    ordered = dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size()))
    return ordered, [tensor_bytes(t) for t in ordered.values()]


def _header_bytes(ordered: Mapping[str, torch.Tensor], blobs: list[memoryview], header: dict) -> bytes:
    """Length prefix + JSON header: the tensor entries and the kvstate header with its own checksum."""
    header = {**header, "header_crc": header_crc(header)}
    entries: dict[str, object] = {"__metadata__": {"kvstate": json.dumps(header, separators=(",", ":"))}}
    offset = 0
    for (name, t), blob in zip(ordered.items(), blobs, strict=True):
        entries[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + blob.nbytes]}
        offset += blob.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (where the platform allows opening folders)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: str | os.PathLike[str], *, verify: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read and validate a state file: (kvstate header, tensors on CPU, owning their memory)."""
    path = Path(path)
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = _read_exactly(f, 8, path)
        head += _read_exactly(f, _header_length(head, size, path), path)
        entries, header, start = _parse_header(head, path, size)
        check_memory(size - start, path)
        sums = _checksums(header, entries, path) if verify else {}
        data = torch.empty(size - start, dtype=torch.uint8)  # the one copy: tensors view into it
        prefer_huge_pages(data)
        view = memoryview(data.numpy()) if data.numel() else memoryview(bytearray())
        hashers = {name: new_hasher(sums[name][0], _seed((e["dtype"], e["shape"])))
                   for name, e in (entries.items() if verify else ())}
        for name, e in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            _read_span(f.fileno(), view[slice(*e["data_offsets"])], start + e["data_offsets"][0], path,
                       hashers.get(name))
    for name, hasher in hashers.items():
        if hasher.hexdigest() != sums[name][1]:
            raise StateFileError("tensor checksum mismatch", expected=sums[name][1], found=hasher.hexdigest(),
                                 fix=f"{name!r} in {path} is corrupt; re-save the state")
    return header, _tensors(data, 0, entries)


def _open_regular(path: Path) -> Any:
    """``path`` opened for reading if it is a regular file; FIFOs, devices and folders are refused first.

    ``O_NONBLOCK`` keeps a FIFO swapped in after the check from blocking the open.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise StateFileError("cannot open state file", found=f"{path}: {exc}",
                             fix="check the path and permissions") from exc
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "folder" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "device or special file"
        raise StateFileError("not a regular file", expected="a state file", found=f"{path} is a {kind}",
                             fix="pass the path of a file written by kvstate's save")
    return os.fdopen(fd, "rb", buffering=0)  # large reads go straight into our buffer


def _read_exactly(f: Any, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise StateFileError("file ends early", expected=f"{n} more bytes", found=f"{len(data)} in {path}",
                             fix="the file is truncated; re-save the state")
    return data


def _read_span(fd: int, target: memoryview, offset: int, path: Path, hasher: Any) -> None:
    """Fill ``target`` with the file's bytes from ``offset`` on, in pieces hashed while they are still
    in cache: one pass over memory, faster than reading everything first and hashing on two threads
    afterwards (docs/benchmarks.md), since hashing from cache costs little next to the copy."""
    for i in range(0, len(target), CHUNK):
        piece = target[i:i + CHUNK]
        done = 0
        while done < len(piece):  # positional reads may return short
            got = _pread_into(fd, piece[done:], offset + i + done)
            if got <= 0:
                raise StateFileError("file ends early", expected=f"{offset + len(target)} bytes",
                                     found=f"{offset + i + done} in {path}",
                                     fix="the file is truncated; re-save the state")
            done += got
        if hasher is not None:
            hasher.update(piece)


_HAS_PREADV = hasattr(os, "preadv")  # a platform fact: looked up once, not per piece


def _pread_into(fd: int, piece: memoryview, offset: int) -> int:
    """Positional read into ``piece``."""
    if _HAS_PREADV:
        return os.preadv(fd, [piece], offset)
    chunk = os.pread(fd, len(piece), offset)  # where preadv is missing: one copy more
    piece[:len(chunk)] = chunk
    return len(chunk)


def parse(data: bytes | bytearray, source: str | os.PathLike[str] = "<bytes>", *,
          verify: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """Validate the bytes of a whole state file: (kvstate header, tensors on CPU).

    Tensors view into ``data`` when it is a ``bytearray`` (no copy); ``bytes`` are copied once.
    """
    path = Path(source)
    entries, header, start = _parse_header(data, path, len(data))
    buffer = data if isinstance(data, bytearray) else bytearray(data)  # writable memory for frombuffer
    if verify:
        for name, (algorithm, expected) in _checksums(header, entries, path).items():
            a, b = (start + o for o in entries[name]["data_offsets"])
            hasher = new_hasher(algorithm, _seed((entries[name]["dtype"], entries[name]["shape"])))
            hasher.update(memoryview(buffer)[a:b])
            if hasher.hexdigest() != expected:
                raise StateFileError("tensor checksum mismatch", expected=expected, found=hasher.hexdigest(),
                                     fix=f"{name!r} in {path} is corrupt; re-save the state")
    whole = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
    return header, _tensors(whole, start, entries)


def read_header(path: str | os.PathLike[str]) -> tuple[dict, dict[str, dict], int]:
    """The kvstate header, the tensor entries and the file size, without reading tensor bytes."""
    path = Path(path)
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        head = _read_exactly(f, 8, path)
        head += _read_exactly(f, _header_length(head, size, path), path)
    entries, header, _ = _parse_header(head, path, size)
    return header, entries, size


def _header_length(prefix: bytes, file_size: int, path: Path) -> int:
    if len(prefix) < 8:
        raise StateFileError("file too short to be a state file", expected=">= 8 bytes",
                             found=f"{len(prefix)} bytes in {path}", fix="re-save the state")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES or n > file_size - 8:
        raise StateFileError("not a state file: its header length is oversized or past the end of the file",
                             expected=f"<= {min(MAX_HEADER_BYTES, max(file_size - 8, 0))} bytes",
                             found=f"{n} bytes in {path}", fix="pass a file written by kvstate's save")
    return n


def _strict_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys {sorted({k for k in keys if keys.count(k) > 1})[:5]}")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} in JSON")


def _json(text: bytes | str) -> Any:
    """Strict JSON: duplicate keys and NaN / Infinity are errors, as in safetensors."""
    return json.loads(text, object_pairs_hook=_strict_object, parse_constant=_no_constant)


def _parse_header(data: bytes | bytearray, path: Path, file_size: int) -> tuple[dict, dict, int]:
    """Header length, JSON and layout of a file of ``file_size`` bytes whose first bytes are ``data``."""
    n = _header_length(bytes(data[:8]), file_size, path)
    if len(data) < 8 + n:
        raise StateFileError("file ends inside its header", expected=f"{8 + n} bytes",
                             found=f"{len(data)} bytes in {path}", fix="the file is truncated")
    try:
        entries = _json(bytes(data[8:8 + n]).decode("utf-8"))
        header = _json(entries["__metadata__"]["kvstate"])
    except (ValueError, RecursionError, TypeError, KeyError) as exc:
        raise StateFileError("header is not a kvstate safetensors header",
                             expected='JSON with __metadata__["kvstate"]',
                             found=f"{type(exc).__name__}: {str(exc)[:120]}", fix="re-save the state") from exc
    if not isinstance(header, dict):
        raise StateFileError("kvstate header is not an object", found=type(header).__name__)
    if header.get("header_crc") != header_crc(header):
        raise StateFileError("header checksum mismatch", expected=header_crc(header),
                             found=header.get("header_crc"), fix=f"{path} is corrupt; re-save the state")
    entries = {k: v for k, v in entries.items() if k != "__metadata__"}
    _check_layout(entries, file_size - 8 - n, path)
    return entries, header, 8 + n


def _checksums(header: dict, entries: dict, path: Path) -> dict[str, tuple[str, str]]:
    """``name -> (algorithm, expected hex)`` for every tensor; the table must cover them all."""
    sums = header.get("checksums")
    if not isinstance(sums, dict) or set(sums) != set(entries) or not all(isinstance(v, str) for v in sums.values()):
        raise StateFileError("checksum table missing or incomplete", expected=sorted(entries),
                             found=sorted(sums) if isinstance(sums, dict) else sums, fix="re-save the state")
    algorithm = header.get("checksum", "crc32")
    if algorithm not in CHECKSUMS:
        raise StateFileError("unknown checksum algorithm", expected=CHECKSUMS, found=algorithm, fix="upgrade kvstate")
    return {name: (algorithm, value) for name, value in sums.items()}


def _check_layout(entries: dict, data_size: int, path: Path) -> None:
    """Every tensor lies inside the data, matches its shape, and regions tile the data exactly."""
    spans = []
    for name, e in entries.items():
        if not (isinstance(e, dict) and e.get("dtype") in _DTYPES and isinstance(e.get("shape"), list)
                and all(isinstance(d, int) and d >= 0 for d in e["shape"])
                and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2
                and all(isinstance(o, int) for o in e["data_offsets"])):
            raise StateFileError("malformed tensor entry", found=f"{name!r}: {str(e)[:120]}")
        start, end = e["data_offsets"]
        numel = 1
        for d in e["shape"]:
            numel *= d
        itemsize = _ITEMSIZE[e["dtype"]]
        if not 0 <= start <= end <= data_size or end - start != numel * itemsize:
            raise StateFileError("tensor bytes out of range or of the wrong size",
                                 expected=f"{numel * itemsize} bytes inside {data_size}",
                                 found=f"{name!r} at [{start}, {end})", fix="the file is truncated or corrupt")
        spans.append((start, end))
    covered = 0
    for start, end in sorted(spans):
        if start != covered:
            raise StateFileError("tensor regions overlap or leave gaps", found=f"region at {start}",
                                 expected=f"next region at {covered}", fix="the file is corrupt")
        covered = end
    if covered != data_size:
        raise StateFileError("bytes trail the last tensor", expected=f"{covered} data bytes",
                             found=f"{data_size} in {path}", fix="the file is corrupt or extended")


def _tensors(data: torch.Tensor, start: int, entries: dict) -> dict[str, torch.Tensor]:
    """Each entry as a view of ``data`` (uint8 bytes; the tensor data begins at ``start``)."""
    out = {}
    for name, e in entries.items():
        a, b = (start + o for o in e["data_offsets"])
        dtype = _DTYPES[e["dtype"]]
        raw = data[a:b]
        if a % _ITEMSIZE[e["dtype"]]:
            raw = raw.clone()  # a view needs the offset aligned to the element size
        out[name] = raw.view(dtype).reshape(e["shape"])
    return out
