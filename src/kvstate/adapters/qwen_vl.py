"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: multimodal RoPE positions as explicit state.

These models keep ``rope_deltas`` (M-RoPE position minus sequence index) on the
model instance, so a cache continued on a fresh instance drifts (the long seed:
max |Δlogit| 17.1 with identical K/V). kvstate never relies on it: every slot's
3-D position ``(t, h, w)`` is stored in the state and every chunk is fed with
explicit ``position_ids`` ``[3, B, Q]``. Image chunks get positions from the model's
own ``get_rope_index`` shifted to the row's next position; text continues at
``max + 1``. ``rope_deltas`` is still kept in ``state.extras`` and written back to
the model, so plain transformers calls on the same instance agree with the state.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from .._compat.core import rope_index, set_rope_deltas
from ..errors import InputError, UnsupportedError
from .base import Adapter, Capabilities
from .fingerprinting import media_digest
from .media import StrayPlaceholders, placeholder_runs, stray_placeholders

_IMAGE_INPUTS = ("pixel_values", "image_grid_thw")
_VIDEO_INPUTS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
_IMAGE, _VIDEO = 1, 2  # transformers' mm_token_type_ids values


@dataclass(frozen=True)
class _Media:
    """One image or video of a row: its placeholder runs ``[start, end)`` (a Qwen3-VL video has one
    run per frame, with timestamp text between them) and its index among the row's items of its kind."""

    kind: int
    runs: tuple[tuple[int, int], ...]
    index: int

    @property
    def span(self) -> tuple[int, int]:
        return self.runs[0][0], self.runs[-1][1]


class QwenVLAdapter(Adapter):
    """``frame_runs``: each video frame is its own placeholder run (Qwen3-VL), else one run per video."""

    caps = Capabilities(name="qwen-vl", position_dims=3,
                        input_keys=(*_IMAGE_INPUTS, "mm_token_type_ids", *_VIDEO_INPUTS))

    def __init__(self, *, frame_runs: bool = False) -> None:
        self._frame_runs = frame_runs

    def chunk_positions(self, model: torch.nn.Module, next_position: torch.Tensor, ids: torch.Tensor,
                        new_mask: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """``[B, Q, 3]`` positions; media chunks follow ``get_rope_index``, text is 1-D repeated."""
        types = _token_types(model, ids)
        if not bool(types.any()) or (inputs.get("image_grid_thw") is None and inputs.get("video_grid_thw") is None):
            flat = super().chunk_positions(model, next_position, ids, new_mask, inputs)
            return flat[..., None].expand(*flat.shape, 3).contiguous()
        positions = rope_index(model, ids, types, new_mask, inputs.get("image_grid_thw"),
                                       inputs.get("video_grid_thw"), inputs.get("second_per_grid_ts"))
        positions = positions + next_position[None, :, None]  # [3, B, Q], from the row's next position
        return positions.permute(1, 2, 0).masked_fill(~new_mask[..., None], 0).contiguous()

    def model_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.permute(2, 0, 1)  # [B, Q, 3] -> [3, B, Q]

    def state_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        if position_ids.dim() == 2:  # text-only 1-D positions: every M-RoPE component is the same
            return position_ids[..., None].expand(*position_ids.shape, 3)
        return position_ids[-3:].permute(1, 2, 0)  # [3 or 4, B, Q] -> [B, Q, 3] (a leading text row is dropped)

    def select_inputs(self, model: torch.nn.Module, ids: torch.Tensor, processed: int,
                      inputs: dict[str, Any]) -> dict[str, Any]:
        """Drop the pixels of images and videos already processed (media are never fed twice)."""
        rest = {k: v for k, v in inputs.items() if k not in (*_IMAGE_INPUTS, *_VIDEO_INPUTS, "mm_token_type_ids")}
        items = self._items(model, ids[0], inputs)
        for kind, (pixels_key, grid_key) in ((_IMAGE, _IMAGE_INPUTS), (_VIDEO, _VIDEO_INPUTS[:2])):
            grid = inputs.get(grid_key)
            if grid is None:
                continue
            done = sum(1 for item in items if item.kind == kind and item.span[0] < processed)
            if done < grid.shape[0]:
                rest[pixels_key] = inputs[pixels_key][int(grid[:done].prod(-1).sum()):]
                rest[grid_key] = grid[done:]
                if kind == _VIDEO and inputs.get("second_per_grid_ts") is not None:
                    rest["second_per_grid_ts"] = inputs["second_per_grid_ts"][done:]
        return rest

    def inputs_until(self, model: torch.nn.Module, ids: torch.Tensor, end: int,
                     inputs: dict[str, Any]) -> dict[str, Any]:
        """The pixels, grids and timings of the images and videos that start before ``end``."""
        rest = {k: v for k, v in inputs.items() if k not in (*_IMAGE_INPUTS, *_VIDEO_INPUTS)}
        if "mm_token_type_ids" in rest:
            rest["mm_token_type_ids"] = rest["mm_token_type_ids"][:, :end]
        items = self._items(model, ids[0], inputs)
        for kind, (pixels_key, grid_key) in ((_IMAGE, _IMAGE_INPUTS), (_VIDEO, _VIDEO_INPUTS[:2])):
            grid = inputs.get(grid_key)
            keep = sum(1 for item in items if item.kind == kind and item.span[0] < end)
            if grid is None or keep == 0:
                continue
            rest[pixels_key] = inputs[pixels_key][:int(grid[:keep].prod(-1).sum())]
            rest[grid_key] = grid[:keep]
            if kind == _VIDEO and inputs.get("second_per_grid_ts") is not None:
                rest["second_per_grid_ts"] = inputs["second_per_grid_ts"][:keep]
        return rest

    def check_inputs(self, model: torch.nn.Module, ids: torch.Tensor, inputs: dict[str, Any], fed_from: int) -> None:
        """Pixels and grids go together and describe exactly the media runs in ``ids`` (one row only)."""
        for kind, (pixels_key, grid_key) in ((_IMAGE, _IMAGE_INPUTS), (_VIDEO, _VIDEO_INPUTS[:2])):
            pixels, grid = inputs.get(pixels_key), inputs.get(grid_key)
            name = "image" if kind == _IMAGE else "video"
            if (pixels is None) != (grid is None):
                raise InputError(f"{pixels_key} and {grid_key} go together", found=sorted(inputs),
                                 fix="pass both, as the processor returns them")
            runs = [_runs(model, row, kind) for row in ids]
            if any(runs) and ids.shape[0] > 1:
                raise UnsupportedError(f"{name}s in a batch of several rows are not supported yet",
                                       found=f"{ids.shape[0]} rows", fix="run one conversation per Session")
            if grid is None:
                unfed = [(a, b) for a, b in runs[0] if b > fed_from] if runs else []
                if unfed:
                    raise InputError(f"{name} placeholders without their pixels", expected=f"{pixels_key} and "
                                     f"{grid_key}", found=f"{name} placeholder runs at {unfed} that are not "
                                     "processed yet", fix=f"pass the {name}s' {pixels_key} and {grid_key}")
                continue
            _check_runs(model, name, runs[0] if runs else [], grid, self._frame_runs and kind == _VIDEO)
            if pixels.shape[0] != int(grid.prod(-1).sum()):
                raise InputError(f"{pixels_key} do not match {grid_key}", expected=int(grid.prod(-1).sum()),
                                 found=pixels.shape[0], fix="pass pixels and grids from one processor call")
        seconds, videos = inputs.get("second_per_grid_ts"), inputs.get("video_grid_thw")
        if seconds is not None and (videos is None or len(seconds) != videos.shape[0]):
            raise InputError("second_per_grid_ts needs one value per video", found=f"{len(seconds)} values for "
                             f"{0 if videos is None else videos.shape[0]} videos", fix="pass it as the processor "
                             "returns it, with the videos")

    def stray_placeholders(self, model: torch.nn.Module, ids: torch.Tensor) -> list[StrayPlaceholders]:
        """Image and video placeholder ids outside a vision-start run: a generated ``<|image_pad|>`` is
        text to ``generate``, but a later forward with pixels counts it as an image token."""
        start = int(model.config.vision_start_token_id)  # type: ignore[union-attr]
        kinds = ((_IMAGE, "image", _IMAGE_INPUTS[0]), (_VIDEO, "video", _VIDEO_INPUTS[0]))
        found = (stray_placeholders(ids, name, _token(model, kind), start, key) for kind, name, key in kinds)
        return [strays for strays in found if strays is not None]

    def media_spans(self, model: torch.nn.Module, ids: torch.Tensor,
                    inputs: dict[str, Any] | None = None) -> tuple[tuple[int, int], ...]:
        """Each image's and video's slots: never split between state and suffix."""
        return tuple(item.span for row in ids for item in self._items(model, row, inputs or {}))

    def media_hashes(self, model: torch.nn.Module, ids: torch.Tensor,
                     inputs: dict[str, Any]) -> list[tuple[int, str]] | None:
        """One hash per image and video; None when the pixels given do not cover every item in ``ids``."""
        items = self._items(model, ids[0], inputs)
        pieces: dict[int, list[str]] = {}
        for kind, (pixels_key, grid_key) in ((_IMAGE, _IMAGE_INPUTS), (_VIDEO, _VIDEO_INPUTS[:2])):
            count = sum(1 for item in items if item.kind == kind)
            grid, pixels = inputs.get(grid_key), inputs.get(pixels_key)
            if count and (grid is None or pixels is None or grid.shape[0] != count
                          or pixels.shape[0] != int(grid.prod(-1).sum())):
                return None  # unhashable as given: check_inputs names the mistake
            if count:
                seconds = inputs.get("second_per_grid_ts") if kind == _VIDEO else None
                parts = pixels.split(grid.prod(-1).tolist())
                pieces[kind] = [f"{'image' if kind == _IMAGE else 'video'}:" + media_digest(
                    p, g, *([] if seconds is None else [torch.as_tensor(seconds[i]).reshape(1)]))
                    for i, (p, g) in enumerate(zip(parts, grid, strict=True))]
        return [(item.span[0], pieces[item.kind][item.index]) for item in items]

    def _items(self, model: torch.nn.Module, row: torch.Tensor, inputs: dict[str, Any]) -> list[_Media]:
        """The row's images and videos in order. Qwen3-VL frames are grouped into videos by the
        grid's frame counts; without the grid each frame run stands alone."""
        items = [_Media(_IMAGE, (run,), i) for i, run in enumerate(_runs(model, row, _IMAGE))]
        frames = _runs(model, row, _VIDEO)
        grid = inputs.get("video_grid_thw")
        if self._frame_runs and grid is not None and int(grid[:, 0].sum()) == len(frames):
            counts, first = grid[:, 0].tolist(), 0
            groups = []
            for n in counts:
                groups.append(tuple(frames[first:first + n]))
                first += n
        else:
            groups = [(run,) for run in frames]
        items += [_Media(_VIDEO, runs, j) for j, runs in enumerate(groups)]
        return sorted(items, key=lambda item: item.span[0])

    def synthetic_image(self, model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, Any]]:
        """A random image of (2m x 2m) patches, m the spatial merge: 4 placeholder tokens."""
        config, vision = model.config, model.config.vision_config  # type: ignore[union-attr]
        m = vision.spatial_merge_size
        gen = torch.Generator().manual_seed(0)
        dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        pixels = torch.randn(4 * m * m, dim, generator=gen).to(next(model.parameters()).dtype)
        span = torch.tensor([[config.vision_start_token_id, *[config.image_token_id] * 4, config.vision_end_token_id]])
        return span, {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 2 * m, 2 * m]])}

    def image_tokens(self, model: torch.nn.Module) -> tuple[int, int, int]:
        config = model.config  # type: ignore[union-attr]
        return int(config.vision_start_token_id), _token(model, _IMAGE), int(config.vision_end_token_id)

    def synthetic_video(self, model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, Any]]:
        """A random video of 2 temporal patches of (2m x 2m) patches: 8 placeholder tokens, in one run
        (Qwen2/2.5-VL) or one run per temporal patch after 2 timestamp tokens (Qwen3-VL)."""
        config, vision = model.config, model.config.vision_config  # type: ignore[union-attr]
        m = vision.spatial_merge_size
        gen = torch.Generator().manual_seed(1)
        dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        pixels = torch.randn(2 * 4 * m * m, dim, generator=gen).to(next(model.parameters()).dtype)
        start, video, end = config.vision_start_token_id, config.video_token_id, config.vision_end_token_id
        if self._frame_runs:
            row = [x for k in range(2) for x in (11 + k, 12 + k, start, *[video] * 4, end)]
        else:
            row = [start, *[video] * 8, end]
        inputs: dict[str, Any] = {"pixel_values_videos": pixels, "video_grid_thw": torch.tensor([[2, 2 * m, 2 * m]])}
        if "second_per_grid_ts" in inspect.signature(model.forward).parameters:  # type: ignore[operator]
            inputs["second_per_grid_ts"] = torch.tensor([1.0])
        return torch.tensor([row]), inputs

    def plain_inputs(self, model: torch.nn.Module, ids: torch.Tensor, inputs: dict[str, Any]) -> dict[str, Any]:
        """Plain Qwen-VL needs ``mm_token_type_ids`` to compute M-RoPE positions itself."""
        return {**inputs, "mm_token_type_ids": _token_types(model, ids)}

    def capture_extras(self, model: torch.nn.Module, next_position: torch.Tensor,
                       tokens_seen: int) -> dict[str, torch.Tensor]:
        return {"rope_deltas": (next_position - tokens_seen)[:, None]}

    def restore_extras(self, model: torch.nn.Module, extras: dict[str, torch.Tensor]) -> None:
        set_rope_deltas(model, extras.get("rope_deltas"))

    def reset_model(self, model: torch.nn.Module) -> None:
        set_rope_deltas(model, None)


def _token(model: torch.nn.Module, kind: int) -> int:
    config = model.config  # type: ignore[union-attr]
    return int(config.image_token_id if kind == _IMAGE else config.video_token_id)


def _token_types(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids`` ``[B, Q]``: 0 text, 1 image, 2 video placeholders (of real media runs)."""
    types = torch.zeros_like(ids, dtype=torch.int)
    for b, row in enumerate(ids):
        for kind in (_IMAGE, _VIDEO):
            for start, end in _runs(model, row, kind):
                types[b, start:end] = kind
    return types


def _check_runs(model: torch.nn.Module, name: str, runs: list[tuple[int, int]], grid: torch.Tensor,
                frame_runs: bool) -> None:
    """The placeholder runs are exactly what ``grid`` ``[N, 3]`` (t, h, w per item) makes."""
    merge = int(model.config.vision_config.spatial_merge_size)  # type: ignore[union-attr]
    if frame_runs:  # one run of h*w/m^2 per frame
        need = [int(h * w) // merge**2 for t, h, w in grid.tolist() for _ in range(int(t))]
    else:
        need = (grid.prod(-1) // merge**2).tolist()
    have = [b - a for a, b in runs]
    if len(need) < len(have):  # e.g. only the newest item's pixels with a full history
        raise InputError(f"pixels for {grid.shape[0]} {name}(s) do not cover the {len(have)} {name} runs in these "
                         "ids", expected=f"pixels and grids for every {name} run {runs}",
                         found=f"{name} grids for {len(need)} runs", fix=f"pass every {name} of the history, in "
                         f"order: kvstate checks each against the {name}s it processed and never re-encodes one it "
                         f"holds (or pass no {name} pixels if every {name} is already processed)")
    if need != have:
        raise InputError(f"{name} placeholders do not match the {name} grid", expected=f"runs of {need} tokens",
                         found=f"runs of {have} tokens", fix=f"pass every {name} of the history, in order, with "
                         "the ids the processor made for them")


def _runs(model: torch.nn.Module, row: torch.Tensor, kind: int) -> list[tuple[int, int]]:
    """The media placeholder runs of ``kind`` in one row (after a vision-start token)."""
    return placeholder_runs(row, _token(model, kind), int(model.config.vision_start_token_id))  # type: ignore[union-attr]
