"""Saving, loading and inspecting state files: the public face of ``container`` + ``schema``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import torch

from ..errors import DeviceUnavailableError, InputError, StateFileError
from ..state import State
from . import container, schema


def save_state(state: State, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None,
               compact: str | None = None) -> int:
    """Write ``state`` to ``path`` atomically; returns the file size in bytes.

    ``compact`` (``"bfloat16"``, ``"float16"`` or ``"int8"``) stores K/V lossily in
    fewer bytes; the header records it and a loaded state notes it in ``metadata``.
    Only a regular file or a new name is replaced (a symlink to a regular file is written
    through); a device, FIFO, socket, folder or dangling link raises ``SaveTargetError`` first.
    """
    _check_state(state)
    header, tensors = schema.encode(state, metadata, compact)
    return container.write(_path(path), tensors, header)


def state_to_bytes(state: State, *, metadata: Mapping[str, str] | None = None) -> bytes:
    """The state file of ``state`` as bytes."""
    _check_state(state)
    header, tensors = schema.encode(state, metadata)
    return container.to_bytes(tensors, header)


def state_from_bytes(data: bytes | bytearray, source: str = "<bytes>") -> State:
    """Parse and validate state-file bytes (same checks as ``load_state``)."""
    return schema.decode(*container.parse(bytearray(data), source))


def load_state(path: str | os.PathLike[str], *, map_location: torch.device | str | None = None,
               dtype: torch.dtype | None = None) -> State:
    """Read and validate a state file. Never unpickles; defects raise ``StateFileError``.

    Args:
        map_location: device for every tensor (default: CPU).
        dtype: cast K/V, logits and floating extras to this dtype (explicit opt-in; the
            cast is recorded in ``state.metadata["kvstate.cast"]``).
    """
    device = _device(map_location)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InputError("load_state's dtype must be a floating torch dtype", expected="torch.float32, "
                         "torch.bfloat16, torch.float16 or None", found=repr(dtype), fix="pass dtype=torch.bfloat16")
    state = schema.decode(*container.read(_path(path)))
    if dtype is not None and state.kv_dtype not in (None, dtype):
        state = _cast(state, dtype)
    # files load onto the CPU; moving there again would only rebuild every layer
    return state if device is None or device.type == "cpu" else state.to(device)


def _check_state(state: object) -> None:
    if not isinstance(state, State):
        raise InputError("only a kvstate State can be saved", expected="a State (session.state)",
                         found=type(state).__name__, fix="save session.state, or session.save(path)")


def _device(map_location: object) -> torch.device | None:
    """``map_location`` as a device this machine has (None: the CPU, where files load), or a typed error."""
    if map_location is None:
        return None
    try:
        device = torch.device(map_location)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as exc:
        raise InputError("map_location must be a device", expected="'cpu', 'cuda', 'cuda:1', a torch.device or None",
                         found=repr(map_location), fix="pass map_location='cpu'") from exc
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():  # 0 without CUDA
        raise DeviceUnavailableError("this machine has no such device", expected="a device it has",
                                     found=str(device), fix="load onto map_location='cpu'")
    return device


def _path(path: object) -> str | os.PathLike[str]:
    """A file path, or a typed error (``Path(None)`` would raise a bare TypeError)."""
    if isinstance(path, (str, os.PathLike)):
        return path
    raise StateFileError("a state file path must be a str or os.PathLike", expected="'state.kvs' or a Path",
                         found=type(path).__name__, fix="pass the file's path")


def _cast(state: State, dtype: torch.dtype) -> State:
    source = str(state.kv_dtype).removeprefix("torch.")
    target = str(dtype).removeprefix("torch.")
    layers = tuple(_cast_layer(layer, dtype) for layer in state.layers)
    checkpoints = tuple(replace(c, layers=MappingProxyType({i: _cast_layer(layer, dtype)
                                                            for i, layer in c.layers.items()}))
                        for c in state.checkpoints)
    extras = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.extras.items()}
    fingerprint = None if state.fingerprint is None else replace(state.fingerprint, dtype=target)
    return replace(state, layers=layers, checkpoints=checkpoints, extras=MappingProxyType(extras),
                   last_logits=None if state.last_logits is None else state.last_logits.to(dtype),
                   fingerprint=fingerprint, canonical=0,  # cast K/V are not what this dtype computes
                   metadata=MappingProxyType({**state.metadata, "kvstate.cast": f"{source} -> {target}"}))


def _cast_layer(layer: Any, dtype: torch.dtype) -> Any:
    """K/V and conv windows follow the model dtype; recurrent states stay float32, as transformers keeps them."""
    return type(layer).from_parts(layer.meta(), {
        k: v.to(dtype) if k in ("keys", "values") or k.startswith("conv.") else v
        for k, v in layer.tensors().items()})


def inspect_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON-able description of a state file (schema: docs/inspect.schema.json).

    Reads the header only, and validates it as a load would (without allocating what it
    declares); tensor bytes are counted from their declared sizes.
    """
    header, entries, size = container.read_header(_path(path))
    schema.validate(header, entries)
    try:
        return _describe(path, header, entries, size)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise StateFileError("state header is malformed", found=f"{type(exc).__name__}: {exc}",
                             fix="re-save the state") from exc


def _describe(path: str | os.PathLike[str], header: dict[str, Any], entries: dict[str, Any],
              size: int) -> dict[str, Any]:
    tensor_bytes = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in entries.values())
    layers = []
    for i, spec in enumerate(header.get("layers", [])):
        runs = spec.get("positions")
        runs = [[spec["position_range"]]] if runs in ("tensor", "heads") else runs or []
        starts = [run[0] for row in runs for run in row if run[1] > 0]
        ends = [run[0] + run[1] - 1 for row in runs for run in row if run[1] > 0]
        layer_bytes = sum(e["data_offsets"][1] - e["data_offsets"][0] for name, e in entries.items()
                          if name.startswith(f"layers.{i}."))
        keys = entries.get(f"layers.{i}.keys")
        held = 0 if keys is None else keys["shape"][0] * keys["shape"][1] * keys["shape"][2]
        layers.append({"index": i, "kind": spec.get("kind"), "tokens_seen": spec.get("tokens_seen"),
                       "slots": spec.get("slots"), "window": spec.get("window"),
                       "positions": [min(starts), max(ends)] if starts else None, "bytes": layer_bytes,
                       "per_head": spec.get("per_head") is True, "entries": spec.get("entries", held)})
    return {
        "path": str(path), "format": header["format"], "version": header["version"],
        "model": header.get("fingerprint"), "batch_size": header.get("batch_size"),
        "tokens_seen": header.get("tokens_seen"), "next_position": header.get("next_position"),
        "storage": header.get("storage"), "kv_dtype": header.get("kv_dtype"), "device": header.get("device"),
        "file_bytes": size, "tensor_bytes": tensor_bytes, "has_last_logits": header.get("has_last_logits"),
        "extras": {name: entries.get(f"extras.{name}", {}).get("shape") for name in header.get("extras", [])},
        "metadata": header.get("metadata", {}), "layers": layers, "created_with": header.get("created_with"),
    }
