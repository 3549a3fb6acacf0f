"""What the engine's runs give: a run's ``Outcome`` and each row's finish reason. (What they take: a ``Feed``,
a ``Request`` and a ``ResumePlan``, values of the layers below, and the ``Settings``.)"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..options import GenerateOptions, end_ids
from ..state import MediaItem, State


@dataclass(frozen=True)
class Outcome:
    """A ``generate`` run: the state after it, the state right after the history was fed (before
    decoding), the new tokens ``[B, N]``, what ``generate`` returns (the tokens, or transformers'
    output object with ``return_dict_in_generate``), the slots reused
    from the plan's source, and each row's ``finish_reason`` (``stop`` or ``length``)."""

    state: State
    prefilled: State
    tokens: torch.Tensor
    output: object
    reused: int
    finish_reason: tuple[str, ...]

    def recorded(self, start: State, media: tuple[MediaItem, ...] | None, keep: int) -> Outcome:
        """This outcome (which continued ``start``) with its states recording the ``media`` items they
        processed, and a checkpoint at the end (the newest ``keep`` kept)."""
        final = self.state.with_checkpoint(keep).with_media(start, media)
        return replace(self, state=final, prefilled=self.prefilled.with_media(start, media))


def finish_reasons(new: torch.Tensor, options: GenerateOptions, history_length: int) -> tuple[str, ...]:
    """Each row's ``finish_reason``: ``length`` when it used its whole token budget without an
    end-of-sequence id, else ``stop`` (an end id, a stop string or a stopping criterion)."""
    config = options.config
    limit = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - history_length
    ends = end_ids(config)
    out = []
    for row in new.tolist():
        stopped = any(token in ends for token in row) or len(row) < limit
        out.append("stop" if stopped else "length")
    return tuple(out)
