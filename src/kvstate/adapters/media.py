"""Placeholder runs: where a processor put an image's or video's tokens in a row of ids, and the
placeholder ids that stand outside any such run (a model generated them, or text held them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def placeholder_runs(row: torch.Tensor, token: int, opener: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of ``token`` in one row ``[L]`` that a processor made: right after
    the ``opener`` token (vision start, begin-of-image), or at the row's start, since a chunk that
    continues a state may begin inside the media's layout. A placeholder id a model generated is
    text, as it is to plain ``generate``, which marks generated tokens as text."""
    is_token = (row == token).int()
    edges = torch.diff(torch.cat([is_token.new_zeros(1), is_token, is_token.new_zeros(1)]))
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return [(a, b) for a, b in zip(starts, ends, strict=True) if a == 0 or int(row[a - 1]) == opener]


@dataclass(frozen=True)
class StrayPlaceholders:
    """The ``slots`` ``(row, slot)`` of ``ids`` ``[B, L]`` that hold the ``kind``'s placeholder id ``token``
    outside every run a processor made. ``pixels_key`` is the input that carries that kind's pixels:
    transformers counts every ``token`` in a forward's ids against those pixels' features."""

    kind: str
    token: int
    pixels_key: str
    slots: tuple[tuple[int, int], ...]


def stray_placeholders(ids: torch.Tensor, kind: str, token: int, opener: int,
                       pixels_key: str) -> StrayPlaceholders | None:
    """The ``token`` ids of ``ids`` ``[B, L]`` outside ``placeholder_runs``; None when there are none."""
    slots = []
    for b, row in enumerate(ids):
        inside = torch.zeros_like(row, dtype=torch.bool)
        for start, end in placeholder_runs(row, token, opener):
            inside[start:end] = True
        slots += [(b, s) for s in ((row == token) & ~inside).nonzero().flatten().tolist()]
    return StrayPlaceholders(kind, token, pixels_key, tuple(slots)) if slots else None
