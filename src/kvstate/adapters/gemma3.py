"""Gemma 3 with images: image tokens attend to each other bidirectionally (media state).

Gemma 3's processor marks image tokens with ``token_type_ids``; the model turns them into a
block mask, so an image's tokens see the whole image while text stays causal. Transformers
reads that mask by position from the start of the sequence, so a chunk that holds an image
needs the token types of the whole history, not of the chunk alone: kvstate rebuilds them for
every forward from the state's tokens (``forward_inputs``). An image is never split between the
state and the next chunk (``media_spans``), so its block is always whole inside one forward, and
later text sees the cached image causally, exactly as in a full prefill.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InputError, UnsupportedError
from .base import Adapter, Capabilities
from .fingerprinting import media_digest
from .media import StrayPlaceholders, placeholder_runs, stray_placeholders


class Gemma3Adapter(Adapter):
    caps = Capabilities(name="gemma3", input_keys=("pixel_values", "token_type_ids"))

    def select_inputs(self, model: torch.nn.Module, ids: torch.Tensor, processed: int,
                      inputs: dict[str, Any]) -> dict[str, Any]:
        """The pixels of images not processed yet (images are never fed twice); token types are
        rebuilt per forward."""
        pixels = inputs.get("pixel_values")
        if pixels is None:
            return {}
        done = sum(1 for start, _ in _runs(model, ids[0]) if start < processed)
        return {"pixel_values": pixels[done:]} if done < pixels.shape[0] else {}

    def inputs_until(self, model: torch.nn.Module, ids: torch.Tensor, end: int,
                     inputs: dict[str, Any]) -> dict[str, Any]:
        pixels = inputs.get("pixel_values")
        if pixels is None:
            return inputs
        keep = sum(1 for start, _ in _runs(model, ids[0]) if start < end)
        return {"pixel_values": pixels[:keep]} if keep else {}

    def forward_inputs(self, model: torch.nn.Module, before: torch.Tensor, ids: torch.Tensor,
                       inputs: dict[str, Any]) -> dict[str, Any]:
        """``token_type_ids`` ``[B, T + Q]`` over the whole history when the chunk holds images."""
        if inputs.get("pixel_values") is None:
            return {}
        return {"pixel_values": inputs["pixel_values"], "token_type_ids": _types(model, torch.cat([before, ids], 1))}

    def check_inputs(self, model: torch.nn.Module, ids: torch.Tensor, inputs: dict[str, Any], fed_from: int) -> None:
        """One image of ``mm_tokens_per_image`` placeholders per pixel row, one row of ids only."""
        pixels = inputs.get("pixel_values")
        runs = [_runs(model, row) for row in ids]
        if any(runs) and ids.shape[0] > 1:
            raise UnsupportedError("images in a batch of several rows are not supported yet",
                                   found=f"{ids.shape[0]} rows", fix="run one conversation per Session")
        runs0 = runs[0] if runs else []
        if pixels is None:
            unfed = [(a, b) for a, b in runs0 if b > fed_from]
            if unfed:
                raise InputError("image placeholders without their pixels", expected="pixel_values",
                                 found=f"image placeholder runs at {unfed} that are not processed yet",
                                 fix="pass the images' pixel_values")
            return
        size = int(model.config.mm_tokens_per_image)  # type: ignore[union-attr]
        if pixels.dim() != 4 or pixels.shape[0] != len(runs0) or any(b - a != size for a, b in runs0):
            raise InputError("pixel_values do not match the image placeholders",
                             expected=f"[{len(runs0)}, C, H, W] for runs {runs0} of {size} tokens each",
                             found=f"pixel_values {tuple(pixels.shape)}", fix="pass every image of the history, "
                             "in order, with the ids the processor made for them (or no pixels if every image is "
                             "already processed)")

    def stray_placeholders(self, model: torch.nn.Module, ids: torch.Tensor) -> list[StrayPlaceholders]:
        """Image placeholder ids outside a begin-of-image run (a generated one is text to ``generate``)."""
        config = model.config  # type: ignore[union-attr]
        strays = stray_placeholders(ids, "image", int(config.image_token_id), int(config.boi_token_id), "pixel_values")
        return [] if strays is None else [strays]

    def media_spans(self, model: torch.nn.Module, ids: torch.Tensor,
                    inputs: dict[str, Any] | None = None) -> tuple[tuple[int, int], ...]:
        """Each image's placeholders: one bidirectional block, never split."""
        return tuple(span for row in ids for span in _runs(model, row))

    def media_hashes(self, model: torch.nn.Module, ids: torch.Tensor,
                     inputs: dict[str, Any]) -> list[tuple[int, str]] | None:
        runs, pixels = _runs(model, ids[0]), inputs.get("pixel_values")
        if not runs:
            return []
        if pixels is None or pixels.shape[0] != len(runs):
            return None  # check_inputs names the mistake
        return [(start, "image:" + media_digest(p)) for (start, _), p in zip(runs, pixels, strict=True)]

    def plain_inputs(self, model: torch.nn.Module, ids: torch.Tensor, inputs: dict[str, Any]) -> dict[str, Any]:
        """Plain Gemma 3 takes the processor's ``token_type_ids``."""
        return {**inputs, "token_type_ids": _types(model, ids)}

    def synthetic_image(self, model: torch.nn.Module) -> tuple[torch.Tensor, dict[str, Any]]:
        """A random image at the vision tower's size: ``mm_tokens_per_image`` placeholders."""
        config = model.config  # type: ignore[union-attr]
        size = int(config.vision_config.image_size)
        gen = torch.Generator().manual_seed(0)
        pixels = torch.randn(1, int(config.vision_config.num_channels), size, size, generator=gen)
        span = torch.tensor([[config.boi_token_id, *[config.image_token_id] * config.mm_tokens_per_image,
                              config.eoi_token_id]])
        return span, {"pixel_values": pixels.to(next(model.parameters()).dtype)}


def _types(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """``token_type_ids`` ``[B, L]``: 1 on the image placeholders of ``ids``, as the processor sets them."""
    types = torch.zeros_like(ids)
    for b, row in enumerate(ids):
        for start, end in _runs(model, row):
            types[b, start:end] = 1
    return types


def _runs(model: torch.nn.Module, row: torch.Tensor) -> list[tuple[int, int]]:
    config = model.config  # type: ignore[union-attr]
    return placeholder_runs(row, int(config.image_token_id), int(config.boi_token_id))
