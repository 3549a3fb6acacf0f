"""State files: one safetensors file per ``State``, crash-safe and safe to load.

Layout (plain safetensors, readable by ``safetensors.safe_open``)::

    u64 little-endian N | N bytes JSON header | tensor bytes

The JSON header maps tensor names to ``{dtype, shape, data_offsets}`` and carries
``__metadata__["kvstate"]``, a JSON string with kvstate's own versioned header (see
``kvstate.io.schema``), which includes a CRC-32 of every tensor.

Loading never unpickles, never trusts a size it has not checked against the file,
and turns every defect into ``StateFileError``: the header length is capped, every
tensor must lie inside the file, shapes must match their byte ranges, regions may
not overlap, nothing may trail, and checksums must match. Saving writes a
temporary file in the target folder, fsyncs it, then renames it over the target,
so a crash leaves the previous file intact.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
import zlib
from collections.abc import Mapping
from pathlib import Path

import torch

from ..errors import StateFileError

MAX_HEADER_BYTES = 64 * 2**20  # generous for token lists; bounds what a hostile file can make us parse
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


def crc32(tensor: torch.Tensor) -> str:
    """CRC-32 over a tensor's dtype, shape and bytes, as 8 hex digits (integrity, not authentication).

    Binding dtype and shape means a header edit that reinterprets intact bytes is caught too.
    """
    seed = zlib.crc32(f"{_NAMES[tensor.dtype]}{list(tensor.shape)}".encode())
    return f"{zlib.crc32(_bytes(tensor), seed) & 0xFFFFFFFF:08x}"


def header_crc(header: dict) -> str:
    """CRC-32 of the kvstate header in canonical JSON, without its own ``header_crc`` field."""
    body = {k: v for k, v in header.items() if k != "header_crc"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


def _bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], header: dict) -> int:
    """Atomically write ``tensors`` plus the kvstate ``header`` (JSON-able) to ``path``."""
    path = Path(path)
    raw, blobs = _layout(tensors, header)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            for blob in blobs:
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return len(raw) + sum(blob.nbytes for blob in blobs)


def to_bytes(tensors: Mapping[str, torch.Tensor], header: dict) -> bytes:
    """The whole file as bytes (for stores that keep values, not files)."""
    raw, blobs = _layout(tensors, header)
    return b"".join([raw, *blobs])


def _layout(tensors: Mapping[str, torch.Tensor], header: dict) -> tuple[bytes, list[memoryview]]:
    """Length prefix + JSON header (with checksums of header and tensors), and the tensor bytes in order."""
    # widest elements first keeps every tensor aligned for zero-copy loading
    tensors = dict(sorted(tensors.items(), key=lambda kv: -kv[1].element_size()))
    blobs = {name: _bytes(t) for name, t in tensors.items()}
    header = {**header, "header_crc": header_crc(header)}
    entries: dict[str, object] = {"__metadata__": {"kvstate": json.dumps(header, separators=(",", ":"))}}
    offset = 0
    for name, t in tensors.items():
        size = blobs[name].nbytes
        entries[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
    return struct.pack("<Q", len(raw)) + raw, list(blobs.values())


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
    """Read and validate a state file: (kvstate header, tensors on CPU)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)  # the one copy: tensors view into it
            got = f.readinto(data)
    except OSError as exc:
        raise StateFileError("cannot read state file", found=f"{path}: {exc}",
                             fix="check the path and permissions") from exc
    if got != len(data):
        raise StateFileError("file changed size while being read", expected=len(data), found=got)
    return parse(data, path, verify=verify)


def parse(data: bytes | bytearray, source: str | os.PathLike[str] = "<bytes>", *,
          verify: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """Validate the bytes of a whole state file: (kvstate header, tensors on CPU).

    Tensors view into ``data`` when it is a ``bytearray`` (no copy); ``bytes`` are copied once.
    """
    path = Path(source)
    entries, header, start = _parse_header(data, path, len(data))
    tensors = _tensors(data, start, entries, path)
    if verify:
        _verify_checksums(header, tensors, path)
    return header, tensors


def read_header(path: str | os.PathLike[str]) -> tuple[dict, dict[str, dict], int]:
    """The kvstate header, the tensor entries and the file size, without reading tensor bytes."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            n = _header_length(prefix, path.stat().st_size, path)
            data = prefix + f.read(n)
    except OSError as exc:
        raise StateFileError("cannot read state file", found=f"{path}: {exc}") from exc
    size = path.stat().st_size
    entries, header, _ = _parse_header(data, path, size, check_data=False)
    return header, entries, size


def _header_length(prefix: bytes, file_size: int, path: Path) -> int:
    if len(prefix) < 8:
        raise StateFileError("file too short to be a state file", expected=">= 8 bytes",
                             found=f"{len(prefix)} bytes in {path}", fix="re-save the state")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES or n > file_size - 8:
        raise StateFileError("header length is oversized or past the end of the file",
                             expected=f"<= {min(MAX_HEADER_BYTES, max(file_size - 8, 0))} bytes",
                             found=f"{n} bytes in {path}", fix="the file is truncated or not a state file")
    return n


def _parse_header(data: bytes, path: Path, file_size: int,
                  check_data: bool = True) -> tuple[dict, dict, int]:
    n = _header_length(data[:8], file_size, path)
    if len(data) < 8 + n:
        raise StateFileError("file ends inside its header", expected=f"{8 + n} bytes",
                             found=f"{len(data)} bytes in {path}", fix="the file is truncated")
    try:
        entries = json.loads(bytes(data[8:8 + n]).decode("utf-8"))
        header = json.loads(entries["__metadata__"]["kvstate"])
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
    if check_data:
        _check_layout(entries, len(data) - 8 - n, path)
    return entries, header, 8 + n


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
        itemsize = torch.empty(0, dtype=_DTYPES[e["dtype"]]).element_size()
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


def _tensors(data: bytes | bytearray, start: int, entries: dict, path: Path) -> dict[str, torch.Tensor]:
    buffer = data if isinstance(data, bytearray) else bytearray(data)  # writable memory for frombuffer
    out = {}
    for name, e in entries.items():
        a, b = (start + o for o in e["data_offsets"])
        dtype = _DTYPES[e["dtype"]]
        if b == a:
            out[name] = torch.empty(e["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=b - a, offset=a)
        if a % raw.new_empty(0, dtype=dtype).element_size():
            raw = raw.clone()  # a view needs the offset aligned to the element size
        out[name] = raw.view(dtype).reshape(e["shape"])
    return out


def _verify_checksums(header: dict, tensors: dict[str, torch.Tensor], path: Path) -> None:
    sums = header.get("checksums")
    if not isinstance(sums, dict) or set(sums) != set(tensors):
        raise StateFileError("checksum table missing or incomplete", expected=sorted(tensors),
                             found=sorted(sums) if isinstance(sums, dict) else sums, fix="re-save the state")
    for name, t in tensors.items():
        if crc32(t) != sums[name]:
            raise StateFileError("tensor checksum mismatch", expected=sums[name], found=crc32(t),
                                 fix=f"{name!r} in {path} is corrupt; re-save the state")
