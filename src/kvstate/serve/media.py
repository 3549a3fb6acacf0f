"""Images of a chat request to model inputs (Qwen-VL): pixels, grids and expanded placeholders.

The renderer writes one ``start, placeholder, end`` group per ``image_url`` part (the
ids come from the family adapter's ``image_tokens``); here the image processor turns
the decoded images into ``pixel_values`` and ``image_grid_thw``, and each group's
placeholder is repeated once per image token, as the model's processor would. The
session hashes the pixels into its reuse keys, so a pooled or stored state is reused
only up to the first image whose content differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import BadRequest


class ImageEncoder:
    """``image_processor`` (a transformers image processor) plus the tokenizer and the adapter's image tokens."""

    def __init__(self, image_processor: Any, tokenizer: Any, tokens: tuple[int, int, int]) -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.start, self.pad, self.end = tokenizer.convert_ids_to_tokens(list(tokens))
        self.ids = set(tokens)
        self.placeholder = self.start + self.pad + self.end
        self.merge = int(getattr(image_processor, "merge_size", 1) or 1)

    def encode(self, ids: Sequence[int], images: Sequence[Any]) -> tuple[list[int], dict[str, Any]]:
        """The rendered chat's ``ids`` (one ``start, pad, end`` group per image) with each image's pad repeated
        once per image token, as tokenizing the expanded text would give (the pads are special tokens), and
        the image inputs ``pixel_values`` ``[patches, D]`` and ``image_grid_thw`` ``[n_images, 3]``."""
        pad = self.tokenizer.convert_tokens_to_ids(self.pad)
        if list(ids).count(pad) != len(images):
            raise BadRequest("the messages' text contains image placeholder tokens", param="messages",
                             fix="send images as image_url parts, not as placeholder text")
        try:
            out = self.image_processor(images=list(images), return_tensors="pt")
        except ValueError as exc:  # what the processor cannot take (Qwen-VL: an aspect ratio past 200)
            raise BadRequest(f"the image cannot be processed: {str(exc)[:200]}", param="messages",
                             fix="send an image closer to square and of a usual size") from exc
        grid = out["image_grid_thw"]
        counts = iter((grid.prod(-1) // self.merge**2).tolist())
        expanded = [t for token in ids for t in ([pad] * next(counts) if token == pad else [token])]
        return expanded, {"pixel_values": out["pixel_values"], "image_grid_thw": grid}

    def check_text_only(self, ids: Sequence[int]) -> None:
        """A prompt without images must not smuggle in image tokens (the model would read missing pixels)."""
        if any(t in self.ids for t in ids):
            raise BadRequest("the prompt contains image tokens but no image", param="messages",
                             fix="send images as image_url parts")
