"""``State`` <-> (kvstate header, named tensors), and optional compact K/V storage.

Header fields (format ``kvstate.state``, version 2, or 3 when a layer's KV heads hold their own slots;
documented in docs/state-file.md):
``format``, ``version``, ``fingerprint``, ``batch_size``, ``tokens_seen``, ``tokens``
(``[B][T]`` ints), ``mask`` (per row, runs ``[start, count]`` of real slots),
``next_position``, ``layers`` (``kind``, ``tokens_seen``, ``slots``, ``window``,
``reserve``, ``positions`` as per-row runs ``[start, count]`` of consecutive
positions, or ``"tensor"`` for multimodal positions stored as a tensor, or ``"heads"`` for
a per-head layer's ``[B, H, S(, R)]`` positions stored as a tensor, with ``per_head`` and
``entries``),
``checkpoints`` (``tokens_seen`` and per-layer ``meta`` of each snapshot),
``has_last_logits``, ``extras`` (names), ``storage`` (``exact``, ``bfloat16``,
``float16`` or ``int8``), ``kv_dtype``, ``device`` (where the state was made: informative, a
load moves it to the model's device), ``metadata`` (str -> str), ``media`` (``[start, end,
digest, kept]`` per processed image or video), ``checksum`` (the algorithm) and ``checksums``.
The model's dtype is the fingerprint's ``dtype``; ``kv_dtype`` is the state's own.
Every count is bounded by the one above it (slots <= a layer's
tokens_seen <= the state's), and the state's by its token list, so a header cannot
make the loader allocate more than the file holds.
The position of every processed slot is the tensor ``positions``.

Only retained slots are written: a sliding layer's K/V that views larger storage is
made contiguous first, so the file holds at most its window, reserve and last append.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from ..errors import StateFileError
from ..identity import Fingerprint
from ..layers import LAYER_KINDS, PAD
from ..schedule import LINES, PROMPT, valid_marks
from ..state import Checkpoint, MediaItem, State
from .container import dtype_of

FORMAT = "kvstate.state"
VERSION = 2  # 2: XXH3-64 tensor checksums (``checksum`` field); 1: CRC-32, still read
HEADS_VERSION = 3  # a file with per-head layers: a reader that predates them refuses it by its version
READABLE = (1, 2, 3)
KERNELS_MAX = 160  # a kernels label: on CUDA it names the GPU (``kvstate._compat.attention.kernels``)
COMPACT = ("bfloat16", "float16", "int8")
_DTYPE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64}


def encode(state: State, metadata: Mapping[str, str] | None = None,
           compact: str | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and the tensors that represent ``state`` in a file."""
    if compact is not None and compact not in COMPACT:
        raise StateFileError("unknown compact storage", expected=COMPACT, found=compact,
                             fix="pass compact=None for exact storage")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise StateFileError("metadata must map str to str", expected="a dict", found=type(metadata).__name__,
                             fix="pass metadata={'note': 'text'}")
    meta = {**state.metadata, **(metadata or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise StateFileError("metadata must map str to str", found=meta)
    tensors: dict[str, torch.Tensor] = {"positions": state.positions.contiguous()}
    layers = [_encode_layer(f"layers.{i}.", layer, tensors, compact) for i, layer in enumerate(state.layers)]
    checkpoints = [{"tokens_seen": c.tokens_seen,
                    "layers": {str(i): _encode_layer(f"checkpoints.{k}.layers.{i}.", layer, tensors, compact)
                               for i, layer in c.layers.items()}}
                   for k, c in enumerate(state.checkpoints)]
    if state.last_logits is not None:
        tensors["last_logits"] = state.last_logits.contiguous()
    for name, t in state.extras.items():
        tensors[f"extras.{name}"] = t.contiguous()
    header = {
        "format": FORMAT, "version": HEADS_VERSION if any(e.get("per_head") for e in layers) else VERSION,
        "fingerprint": None if state.fingerprint is None else state.fingerprint.to_dict(),
        "batch_size": state.batch_size, "tokens_seen": state.tokens_seen,
        "tokens": state.tokens.tolist(), "mask": _mask_runs(state.mask),
        "next_position": state.next_position.tolist(), "layers": layers, "checkpoints": checkpoints,
        "has_last_logits": state.last_logits is not None, "extras": sorted(state.extras),
        "storage": compact or "exact", "kv_dtype": _dtype_name(state.kv_dtype), "device": str(state.device),
        "metadata": meta,
        "media": [[m.start, m.end, m.digest, m.kept] for m in state.media],
        # lossy storage changes K/V bits, so nothing of a compact file is the cold run's
        # turn marks are a 4th entry only when set: a reader that predates them refuses such a file (and line
        # marks begin with a negative entry, which a reader that predates them refuses too)
        "canonical": [0, 0, ""] if compact else [state.canonical, state.canonical_chunk, state.canonical_device,
                                                 *([list(state.canonical_marks)] if state.canonical_marks else [])],
        "created_with": created_with(),
    }
    return header, tensors  # the container adds the checksums as it writes


def _encode_layer(prefix: str, layer: Any, tensors: dict[str, torch.Tensor], compact: str | None) -> dict:
    """Add one layer's tensors under ``prefix``; returns its header entry."""
    parts = dict(layer.tensors())
    positions = parts.pop("positions", None)
    entry = {**layer.meta(), "positions": None}
    if positions is not None and positions.dim() == 2 and not entry.get("per_head"):
        entry["positions"] = _runs(positions)
    elif positions is not None:
        # multimodal [B, S, R] or per-head [B, H, S(, R)]; position_range is [min, count] for inspect
        entry["positions"] = "heads" if entry.get("per_head") else "tensor"
        held = positions[positions >= 0]
        low, high = (int(held.min()), int(held.max())) if held.numel() else (0, -1)
        entry["position_range"] = [low, high - low + 1]
        tensors[f"{prefix}positions"] = positions.contiguous()
    for name, t in parts.items():
        tensors.update(_pack(f"{prefix}{name}", t.contiguous(), compact if name in ("keys", "values") else None))
    return entry


def decode(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> State:
    """Rebuild a ``State``; every field is validated and defects raise ``StateFileError``."""
    try:
        return _decode(header, tensors)
    except StateFileError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise StateFileError("state header is malformed", found=f"{type(exc).__name__}: {str(exc)[:160]}",
                             fix="re-save the state with this kvstate version") from exc


def validate(header: dict[str, Any], entries: dict[str, Any]) -> None:
    """Every check ``decode`` makes, on the header alone: tensors are stood in for by
    shape-only (meta) tensors, so nothing the file declares is allocated."""
    decode(header, {name: torch.empty(e["shape"], dtype=dtype_of(e["dtype"]), device="meta")
                    for name, e in entries.items()})


def _decode(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> State:
    _check_version(header)
    B, T = _int(header, "batch_size"), _int(header, "tokens_seen")
    if B < 1:
        raise StateFileError("batch_size must be at least 1", found=B, fix="re-save the state")
    tokens = torch.tensor(_list(header, "tokens"), dtype=torch.long).reshape(B, T)
    mask = _mask_from_runs(_list(header, "mask"), B, T)
    positions = tensors["positions"]
    if positions.dtype != torch.long or tuple(positions.shape[:2]) != (B, T) or positions.dim() not in (2, 3):
        raise StateFileError("positions have the wrong shape", expected=f"int64 [{B}, {T}(, R)]",
                             found=f"{positions.dtype} {tuple(positions.shape)}")
    kv_dtype = _DTYPE_NAMES.get(header.get("kv_dtype") or "float32")
    if kv_dtype is None:
        raise StateFileError("unknown kv_dtype", expected=sorted(_DTYPE_NAMES), found=header.get("kv_dtype"))
    storage = header.get("storage")
    specs = _list(header, "layers")
    if header.get("version") != HEADS_VERSION and any(isinstance(e, dict) and "per_head" in e for e in specs):
        raise StateFileError("per-head layers in a file of an earlier version", expected=f"version {HEADS_VERSION}",
                             found=header.get("version"), fix="re-save the state; the file is corrupt or crafted")
    layers = tuple(_layer(f"layers.{i}.", spec, tensors, B, kv_dtype, storage, T) for i, spec in enumerate(specs))
    checkpoints = tuple(_checkpoint(k, c, tensors, B, kv_dtype, storage, len(layers), T)
                        for k, c in enumerate(_list(header, "checkpoints")))
    extras = {name: tensors[f"extras.{name}"] for name in _list(header, "extras")}
    last = tensors["last_logits"] if header.get("has_last_logits") is True else None
    if last is not None and (last.dim() != 2 or last.shape[0] != B or not last.is_floating_point()):
        raise StateFileError("last_logits has the wrong shape or dtype", expected=f"floating [{B}, V]",
                             found=f"{_dtype_name(last.dtype)} {tuple(last.shape)}")
    meta = dict(header.get("metadata") or {})
    if header.get("storage") != "exact":
        meta["kvstate.storage"] = f"{header.get('storage')} (lossy)"
    fp = header.get("fingerprint")
    return State(tokens=tokens, mask=mask, positions=positions, layers=layers, checkpoints=checkpoints,
                 next_position=torch.tensor(_list(header, "next_position"), dtype=torch.long).reshape(B),
                 last_logits=last, extras=MappingProxyType(extras),
                 fingerprint=None if fp is None else Fingerprint.from_dict(fp),
                 metadata=MappingProxyType({str(k): str(v) for k, v in meta.items()}), media=_media(header, T),
                 **_canonical(header, T))


def _canonical(header: dict[str, Any], T: int) -> dict[str, Any]:
    """``canonical``, ``canonical_chunk``, ``canonical_device`` and ``canonical_marks``; files written
    before the canonical schedule hold no canonical slots."""
    value = header.get("canonical") or [0, 0, ""]
    marks = value[3] if isinstance(value, list) and len(value) == 4 else []
    if (not isinstance(value, list) or len(value) not in (3, 4) or not all(type(v) is int for v in value[:2])
            or not 0 <= value[0] <= T or not 0 <= value[1] <= 1 << 20 or not isinstance(value[2], str)
            or len(value[2]) > KERNELS_MAX or not isinstance(marks, list) or not valid_marks(marks)
            or (len(value) == 4 and not marks)):
        raise StateFileError("canonical is malformed",
                             expected=f"[slots 0..{T}, chunk 0..2**20, kernels label(, 1-64 turn-mark ids, "
                                      f"{LINES} then line-start ids, or {PROMPT}, gap, label length, label, "
                                      "line-start ids)]",
                             found=str(value)[:120], fix="re-save the state")
    if header.get("storage") != "exact":
        return {"canonical": 0, "canonical_chunk": 0, "canonical_device": ""}
    return {"canonical": value[0], "canonical_chunk": value[1], "canonical_device": value[2],
            "canonical_marks": tuple(marks)}


def _media(header: dict[str, Any], T: int) -> tuple[MediaItem, ...]:
    """The processed media items; files written before media hashes have none (a resume over their
    images then re-feeds from the first image whose pixels are given: never stale K/V)."""
    items = header.get("media") or []
    if not isinstance(items, list):
        raise StateFileError("media must be a list", found=type(items).__name__, fix="re-save the state")
    out = []
    for item in items:
        ok = (isinstance(item, list) and len(item) in (3, 4) and all(type(x) is int for x in item[:2])
              and isinstance(item[2], str) and 0 <= item[0] < item[1] <= T and len(item[2]) <= 128
              and (len(item) == 3 or type(item[3]) is bool))
        if not ok:
            raise StateFileError("a media item is malformed", expected=f"[start, end, digest, kept], 0 <= start < "
                                 f"end <= {T}", found=str(item)[:100], fix="re-save the state")
        out.append(MediaItem(item[0], item[1], item[2], *item[3:]))
    return tuple(out)


def _check_version(header: dict[str, Any]) -> None:
    if header.get("format") != FORMAT:
        raise StateFileError("not a kvstate state file", expected=FORMAT, found=header.get("format"))
    if header.get("version") not in READABLE:
        raise StateFileError("unsupported state file version", expected=READABLE,
                             found=header.get("version"), fix="load it with the kvstate version that wrote it")


def _checkpoint(k: int, entry: Any, tensors: dict[str, torch.Tensor], B: int, kv_dtype: torch.dtype,
                storage: str | None, n_layers: int, T: int) -> Checkpoint:
    seen = _bounded(entry, "tokens_seen", T, "the state's tokens_seen")
    layers = {}
    for key, spec in dict(entry["layers"]).items():
        i = int(key)
        if not 0 <= i < n_layers:
            raise StateFileError("checkpoint names a layer that does not exist", expected=f"0..{n_layers - 1}", found=i)
        layers[i] = _layer(f"checkpoints.{k}.layers.{i}.", spec, tensors, B, kv_dtype, storage, seen)
    return Checkpoint(seen, MappingProxyType(layers))


def _layer(prefix: str, spec: dict[str, Any], tensors: dict[str, torch.Tensor], B: int,
           kv_dtype: torch.dtype, storage: str | None, T: int) -> Any:
    """One layer; ``T`` bounds its counts, so no header number can make us allocate more than the file holds."""
    cls = LAYER_KINDS.get(spec.get("kind"))  # type: ignore[arg-type]
    if cls is None:
        raise StateFileError(f"{prefix} has an unknown layer kind", expected=sorted(LAYER_KINDS),
                             found=spec.get("kind"), fix="upgrade kvstate")
    seen = _bounded(spec, "tokens_seen", T, "the state's tokens_seen")
    slots = _bounded(spec, "slots", seen, f"{prefix} tokens_seen")
    parts = {name[len(prefix):]: t for name, t in tensors.items()
             if name.startswith(prefix) and not name.endswith(".scale") and name[len(prefix):] != "positions"}
    for name in ("keys", "values"):
        if name in parts:
            parts[name] = _unpack(f"{prefix}{name}", tensors, kv_dtype, storage)
            t = parts[name]
            if t.dim() != 4 or t.shape[0] != B or t.shape[2] != slots or (slots and 0 in (t.shape[1], t.shape[3])):
                raise StateFileError(f"{prefix}{name} has the wrong shape", expected=f"[{B}, H, {slots}, D]",
                                     found=tuple(t.shape))
    # K and V share batch, heads and slots; their widths may differ (MLA stores narrower values)
    if slots and ("keys" not in parts or "values" not in parts or parts["keys"].shape[:3] != parts["values"].shape[:3]
                  or seen < slots):
        raise StateFileError(f"{prefix} K/V are incomplete or inconsistent", found=spec)
    if (spec.get("per_head") is True) != (spec.get("positions") == "heads") or \
            (spec.get("per_head") is not None and spec.get("per_head") is not True):
        raise StateFileError(f"{prefix} per_head and its positions disagree", expected="per_head true with "
                             "positions 'heads', or neither", found={"per_head": spec.get("per_head"),
                                                                     "positions": str(spec.get("positions"))[:20]},
                             fix="re-save the state; the file is corrupt or crafted")
    if slots:
        H = parts["keys"].shape[1]
        parts["positions"] = _layer_positions(prefix, spec.get("positions"), tensors, B, slots, H)
    return cls.from_parts(spec, parts)


def _layer_positions(prefix: str, runs: Any, tensors: dict[str, torch.Tensor], B: int, S: int,
                     H: int) -> torch.Tensor:
    if runs == "heads":
        return _head_positions(prefix, tensors[f"{prefix}positions"], B, H, S)
    if runs != "tensor":
        return _positions_from_runs(runs, B, S)
    positions = tensors[f"{prefix}positions"]
    if positions.dtype != torch.long or positions.dim() != 3 or tuple(positions.shape[:2]) != (B, S):
        raise StateFileError(f"{prefix}positions have the wrong shape", expected=f"int64 [{B}, {S}, R]",
                             found=f"{positions.dtype} {tuple(positions.shape)}")
    return positions


def _head_positions(prefix: str, positions: torch.Tensor, B: int, H: int, S: int) -> torch.Tensor:
    """A per-head layer's positions ``[B, H, S(, R)]``: each head's padding (``PAD`` in every component) in
    front of its slots, whose positions are ``>= 0`` (``kvstate.layers``)."""
    if positions.dtype != torch.long or positions.dim() not in (3, 4) or tuple(positions.shape[:3]) != (B, H, S):
        raise StateFileError(f"{prefix}positions have the wrong shape", expected=f"int64 [{B}, {H}, {S}(, R)]",
                             found=f"{positions.dtype} {tuple(positions.shape)}")
    if positions.is_meta:
        return positions
    parts = positions if positions.dim() == 4 else positions[..., None]
    valid = parts[..., 0] != PAD
    padding_first = bool((valid[..., 1:] >= valid[..., :-1]).all())
    consistent = bool(((parts >= 0) == valid[..., None]).all() & (parts[~valid] == PAD).all())
    if not padding_first or not consistent:
        raise StateFileError(f"{prefix}positions are not a per-head layout",
                             expected=f"each head's padding ({PAD} in every component) before its slots, "
                                      "positions >= 0 on slots", found="padding after a slot, or a mixed position",
                             fix="re-save the state; the file is corrupt or crafted")
    return positions


def _pack(name: str, t: torch.Tensor, compact: str | None) -> dict[str, torch.Tensor]:
    if compact is None:
        return {name: t}
    # lossy storage promises finite values: an inf would become NaN (int8) or stay inf unnoticed
    packed = t.to(_DTYPE_NAMES[compact]) if compact != "int8" else t
    if not bool(packed.isfinite().all()):
        bad = int((~packed.isfinite()).sum())
        raise StateFileError(f"compact={compact!r} storage needs finite K/V", expected="finite keys and values",
                             found=f"{name}: {bad} values non-finite as {compact}",
                             fix="save with compact=None (exact storage keeps every value)")
    if compact != "int8":
        return {name: packed}
    # per-channel symmetric int8: one scale per (row, head, dim) over the slots
    scale = (t.float().abs().amax(dim=2, keepdim=True) / 127).clamp_min(1e-12)
    return {name: torch.round(t.float() / scale).clamp(-127, 127).to(torch.int8), f"{name}.scale": scale}


def _unpack(name: str, tensors: dict[str, torch.Tensor], kv_dtype: torch.dtype,
            storage: str | None) -> torch.Tensor:
    """K/V as the model holds them; the stored dtype must be the one ``storage`` writes, and lossy
    storage must hold finite values (it promises them: ``_pack``)."""
    if storage not in ("exact", *COMPACT):
        raise StateFileError("unknown storage", expected=("exact", *COMPACT), found=storage)
    t = tensors[name]
    stored = {"exact": kv_dtype, "int8": torch.int8}.get(storage) or _DTYPE_NAMES[storage]
    if t.dtype != stored:
        raise StateFileError(f"{name} is stored as {_dtype_name(t.dtype)}, not as the header says",
                             expected=f"{_dtype_name(stored)} ({storage} storage of {_dtype_name(kv_dtype)} K/V)",
                             found=_dtype_name(t.dtype), fix="re-save the state; the file is corrupt or crafted")
    if storage == "int8":
        scale = tensors[f"{name}.scale"]
        _check_scale(f"{name}.scale", scale, t)
        return (t.float() * scale).to(kv_dtype)
    if storage != "exact":
        _check_finite(name, t)
    return t.to(kv_dtype)


def _check_scale(name: str, scale: torch.Tensor, payload: torch.Tensor) -> None:
    """int8 scales are float32 ``[B, H, 1, D]``, finite and positive (``_pack`` writes nothing else)."""
    expected = (*payload.shape[:2], 1, *payload.shape[3:]) if payload.dim() == 4 else None
    if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
        raise StateFileError(f"{name} has the wrong shape or dtype", expected=f"float32 {expected}",
                             found=f"{_dtype_name(scale.dtype)} {tuple(scale.shape)}", fix="re-save the state")
    if not scale.is_meta and not bool((scale.isfinite() & (scale > 0)).all()):
        raise StateFileError(f"{name} holds non-finite or non-positive scales", expected="finite scales > 0",
                             found=f"{int((~(scale.isfinite() & (scale > 0))).sum())} bad values",
                             fix="re-save the state; the file is corrupt or crafted")


def _check_finite(name: str, t: torch.Tensor) -> None:
    if not t.is_meta and not bool(t.isfinite().all()):
        raise StateFileError(f"{name} holds non-finite values in lossy storage", expected="finite values",
                             found=f"{int((~t.isfinite()).sum())} non-finite values",
                             fix="re-save the state; the file is corrupt or crafted")


def _runs(positions: torch.Tensor) -> list[list[list[int]]]:
    """Per row, runs ``[start, count]`` of consecutive positions (one run when uncompressed)."""
    out = []
    for row in positions.to("cpu", torch.long):
        if row.numel() == 0:
            out.append([])
            continue
        cuts = torch.nonzero(row[1:] != row[:-1] + 1).flatten() + 1  # where a run ends and the next begins
        starts = torch.cat([cuts.new_zeros(1), cuts])
        counts = torch.cat([cuts, cuts.new_full((1,), row.numel())]) - starts
        out.append([[p, n] for p, n in zip(row[starts].tolist(), counts.tolist(), strict=True)])
    return out


def _positions_from_runs(runs: Any, B: int, S: int) -> torch.Tensor:
    if not isinstance(runs, list) or len(runs) != B:
        raise StateFileError("positions have the wrong number of rows", expected=B, found=runs)
    rows = []
    for row in runs:
        counts = [_pair(r)[1] for r in row]
        if sum(counts) != S:  # checked before allocating anything
            raise StateFileError("positions do not cover the stored slots", expected=S, found=sum(counts))
        rows.append(torch.cat([torch.arange(a, a + n) for a, n in map(_pair, row)]))
    return torch.stack(rows)


def _mask_runs(mask: torch.Tensor) -> list[list[list[int]]]:
    """Per row, runs ``[start, count]`` of real (unpadded) slots."""
    return [_runs(torch.nonzero(row).flatten()[None])[0] for row in mask.to("cpu", torch.bool)]


def _mask_from_runs(runs: list, B: int, T: int) -> torch.Tensor:
    if len(runs) != B:
        raise StateFileError("mask has the wrong number of rows", expected=B, found=len(runs))
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, row in enumerate(runs):
        for start, count in map(_pair, row):
            if start + count > T:
                raise StateFileError("mask run past the end", expected=f"<= {T}", found=start + count)
            mask[b, start:start + count] = True
    return mask


def _pair(run: Any) -> tuple[int, int]:
    if not (isinstance(run, list) and len(run) == 2 and all(type(x) is int for x in run) and run[1] >= 0):
        raise StateFileError("malformed run", expected="[start, count] ints", found=str(run)[:80])
    return run[0], run[1]


def _bounded(d: dict[str, Any], key: str, limit: int, what: str) -> int:
    value = _int(d, key)
    if value > limit:
        raise StateFileError(f"header field {key!r} exceeds {what}", expected=f"<= {limit}", found=value,
                             fix="the file is corrupt or crafted; re-save the state")
    return value


def _int(d: dict[str, Any], key: str) -> int:
    value = d.get(key)
    if type(value) is not int or value < 0:
        raise StateFileError(f"header field {key!r} must be a non-negative int", found=value)
    return value


def _list(d: dict[str, Any], key: str) -> list:
    value = d.get(key)
    if not isinstance(value, list):
        raise StateFileError(f"header field {key!r} must be a list", found=type(value).__name__)
    return value


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def created_with() -> dict[str, str]:
    """The library versions a file is written with (informative: files load across the tested window)."""
    from .._compat import versions
    from .._version import __version__

    return {"kvstate": __version__, "transformers": versions.installed(), "torch": torch.__version__.split("+")[0]}
