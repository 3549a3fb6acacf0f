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

from typing import Any

import torch

from .. import _compat
from ..errors import InputError, UnsupportedError
from ..fingerprint import media_digest
from .base import Adapter, Capabilities

_VIDEO_INPUTS = ("pixel_values_videos", "video_grid_thw")


class QwenVLAdapter(Adapter):
    caps = Capabilities(name="qwen-vl", position_dims=3,
                        input_keys=("pixel_values", "image_grid_thw", "mm_token_type_ids", *_VIDEO_INPUTS))

    def chunk_positions(self, model: torch.nn.Module, next_position: torch.Tensor, ids: torch.Tensor,
                        new_mask: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """``[B, Q, 3]`` positions; image chunks follow ``get_rope_index``, text is 1-D repeated."""
        if any(inputs.get(k) is not None for k in _VIDEO_INPUTS):
            raise UnsupportedError("video inputs are not supported yet", found=sorted(inputs),
                                   fix="pass images (pixel_values, image_grid_thw) only")
        image = ids == model.config.image_token_id  # type: ignore[union-attr]
        grid = inputs.get("image_grid_thw")
        if grid is None or not bool(image.any()):
            flat = super().chunk_positions(model, next_position, ids, new_mask, inputs)
            return flat[..., None].expand(*flat.shape, 3).contiguous()
        positions = _compat.rope_index(model, ids, image, grid, new_mask)  # [3, B, Q], from 0
        positions = positions + next_position[None, :, None]
        return positions.permute(1, 2, 0).masked_fill(~new_mask[..., None], 0).contiguous()

    def model_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions.permute(2, 0, 1)  # [B, Q, 3] -> [3, B, Q]

    def state_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        if position_ids.dim() == 2:  # text-only 1-D positions: every M-RoPE component is the same
            return position_ids[..., None].expand(*position_ids.shape, 3)
        return position_ids[-3:].permute(1, 2, 0)  # [3 or 4, B, Q] -> [B, Q, 3] (a leading text row is dropped)

    def select_inputs(self, model: torch.nn.Module, ids: torch.Tensor, processed: int,
                      inputs: dict[str, Any]) -> dict[str, Any]:
        """Drop pixels of images already processed (they must never be fed twice)."""
        grid = inputs.get("image_grid_thw")
        if grid is None:
            return {k: v for k, v in inputs.items() if k != "mm_token_type_ids"}
        runs = _image_runs(ids[0], int(model.config.image_token_id))  # type: ignore[union-attr]
        done = sum(1 for start, _ in runs if start < processed)
        rows = int(grid[:done].prod(-1).sum())
        rest = {k: v for k, v in inputs.items() if k not in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
        if done < grid.shape[0]:
            rest.update(pixel_values=inputs["pixel_values"][rows:], image_grid_thw=grid[done:])
        return rest

    def check_inputs(self, model: torch.nn.Module, ids: torch.Tensor, inputs: dict[str, Any], fed_from: int) -> None:
        """Pixels and grids go together, describe exactly the image runs in ``ids``, and one row only."""
        pixels, grid = inputs.get("pixel_values"), inputs.get("image_grid_thw")
        token = int(model.config.image_token_id)  # type: ignore[union-attr]
        runs = [_image_runs(row, token) for row in ids]
        if (pixels is None) != (grid is None):
            raise InputError("pixel_values and image_grid_thw go together", found=sorted(k for k in inputs),
                             fix="pass both, as the processor returns them")
        if any(runs) and ids.shape[0] > 1:
            raise UnsupportedError("images in a batch of several rows are not supported yet",
                                   found=f"{ids.shape[0]} rows", fix="run one conversation per Session")
        if grid is None:
            unfed = [(a, b) for a, b in runs[0] if b > fed_from] if runs else []
            if unfed:
                raise InputError("image placeholders without their pixels", expected="pixel_values and image_grid_thw",
                                 found=f"image placeholder runs at {unfed} that are not processed yet",
                                 fix="pass the images' pixel_values and image_grid_thw")
            return
        merge = int(model.config.vision_config.spatial_merge_size)  # type: ignore[union-attr]
        need = (grid.prod(-1) // merge**2).tolist()
        have = [b - a for a, b in runs[0]] if runs else []
        if len(need) < len(have):  # e.g. only the newest image's pixels with a full history
            raise InputError(f"pixels for {len(need)} of the {len(have)} images in these ids",
                             expected=f"pixel_values and image_grid_thw for every image run {runs[0]}",
                             found=f"image_grid_thw for {len(need)}", fix="pass every image of the history, in "
                             "order: kvstate checks each against the images it processed and never re-encodes one "
                             "it holds (or pass no pixels if every image is already processed)")
        if need != have:
            raise InputError("image placeholders do not match image_grid_thw", expected=f"runs of {need} tokens",
                             found=f"runs of {have} tokens", fix="pass every image of the history, in order, with "
                             "the ids the processor made for them")
        if pixels.shape[0] != int(grid.prod(-1).sum()):
            raise InputError("pixel_values do not match image_grid_thw", expected=int(grid.prod(-1).sum()),
                             found=pixels.shape[0], fix="pass pixel_values and image_grid_thw from one processor call")

    def media_spans(self, model: torch.nn.Module, ids: torch.Tensor) -> tuple[tuple[int, int], ...]:
        """Each image's placeholder run: never split between state and suffix."""
        token = int(model.config.image_token_id)  # type: ignore[union-attr]
        return tuple(span for row in ids for span in _image_runs(row, token))

    def media_hashes(self, model: torch.nn.Module, ids: torch.Tensor,
                     inputs: dict[str, Any]) -> list[tuple[int, str]] | None:
        """One hash per image run; None when the pixels given do not cover every image in ``ids``."""
        runs = _image_runs(ids[0], int(model.config.image_token_id))  # type: ignore[union-attr]
        grid = inputs.get("image_grid_thw")
        if not runs:
            return []
        if grid is None or grid.shape[0] != len(runs):
            return None
        sizes = grid.prod(-1).tolist()
        pixels = inputs["pixel_values"].split(sizes)
        return [(start, media_digest(p, g)) for (start, _), p, g in zip(runs, pixels, grid, strict=True)]

    def synthetic_image(self, model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, Any]]:
        """A random image of (2m x 2m) patches, m the spatial merge: 4 placeholder tokens."""
        config, vision = model.config, model.config.vision_config  # type: ignore[union-attr]
        m = vision.spatial_merge_size
        gen = torch.Generator().manual_seed(0)
        dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        pixels = torch.randn(4 * m * m, dim, generator=gen).to(next(model.parameters()).dtype)
        span = torch.tensor([[config.vision_start_token_id, *[config.image_token_id] * 4, config.vision_end_token_id]])
        return span, {"pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 2 * m, 2 * m]])}

    def plain_inputs(self, model: torch.nn.Module, ids: torch.Tensor, inputs: dict[str, Any]) -> dict[str, Any]:
        """Plain Qwen-VL needs ``mm_token_type_ids`` to compute M-RoPE positions itself."""
        return {**inputs, "mm_token_type_ids": (ids == model.config.image_token_id).int()}  # type: ignore[union-attr]

    def capture_extras(self, model: torch.nn.Module, next_position: torch.Tensor,
                       tokens_seen: int) -> dict[str, torch.Tensor]:
        return {"rope_deltas": (next_position - tokens_seen)[:, None]}

    def restore_extras(self, model: torch.nn.Module, extras: dict[str, torch.Tensor]) -> None:
        _compat.set_rope_deltas(model, extras.get("rope_deltas"))

    def reset_model(self, model: torch.nn.Module) -> None:
        _compat.set_rope_deltas(model, None)


def _image_runs(row: torch.Tensor, token: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of image placeholder tokens in one row."""
    is_image = (row == token).int()
    edges = torch.diff(torch.cat([is_image.new_zeros(1), is_image, is_image.new_zeros(1)]))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends, strict=True))
