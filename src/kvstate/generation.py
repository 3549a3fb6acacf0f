"""Generation helpers for the first token drawn from stored logits (no re-feed), then ``generate``.

When a history is already fully processed, ``Session.generate`` picks the first token
from ``state.last_logits`` with transformers' own logits processors, then lets
``model.generate`` continue. These helpers keep the stopping rules and streamers
exactly as one ``generate`` call would see them.
"""

from __future__ import annotations

from typing import Any

import torch


class _SkipFirstPut:
    """Streamer proxy that drops the prompt echo of a continuation ``generate`` call."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.skipped = inner, False

    def put(self, value: torch.Tensor) -> None:
        if self.skipped:
            self.inner.put(value)
        self.skipped = True

    def end(self) -> None:
        self.inner.end()


def eos_ids(config: Any) -> list[int]:
    eos = config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def finished(config: Any, first: torch.Tensor, prompt_len: int) -> bool:
    """Whether generation stops right after the first token (budget or EOS on every row)."""
    budget = (config.max_new_tokens if config.max_new_tokens is not None
              else config.max_length - prompt_len)
    eos = torch.tensor(eos_ids(config), dtype=first.dtype, device=first.device)
    return budget <= 1 or bool(torch.isin(first, eos).all())


def rest_kwargs(kwargs: dict[str, Any], config: Any, streamer: Any) -> dict[str, Any]:
    """Generate kwargs for the continuation after one token was already produced."""
    rest = dict(kwargs, streamer=None if streamer is None else _SkipFirstPut(streamer))
    if config.max_new_tokens is not None:
        rest["max_new_tokens"] = config.max_new_tokens - 1
    if config.min_new_tokens:
        rest["min_new_tokens"] = max(config.min_new_tokens - 1, 0)
    return rest
