"""Placeholder runs: where a processor put an image's or video's tokens in a row of ids."""

from __future__ import annotations

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
