"""The values the engine's schedules take and give: a feed, its settings, and a run's outcome."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from ..options import GenerateOptions, end_ids
from ..state import MediaItem, State


@dataclass(frozen=True)
class Feed:
    """New tokens for the model: ``ids`` ``[B, Q]``, ``mask`` ``[B, T + Q]`` over processed + new
    slots, their ``positions`` ``[B, Q(, R)]``, the model inputs that belong to them (pixels), and
    the media ``spans`` ``[start, end)`` among them, as absolute slots (never split by a chunk)."""

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    inputs: Mapping[str, torch.Tensor]
    spans: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class FeedSettings:
    """How ``feed`` splits its work: the canonical chunk ``C`` (0: off), the longest forward when
    the schedule is off, checkpoint spacing and checkpoints kept, the schedule's turn marks, and
    the prefill tile: chunks run in packed forwards whose products take ``tile`` rows at a time
    (0: plain forwards; ``kvstate.engine.batched.prefill``), on prepacked weights with ``prepack``."""

    chunk_size: int = 512
    checkpoint_every: int | None = None
    max_checkpoints: int = 16
    canonical: int = 0
    marks: tuple[int, ...] = ()
    tile: int = 0
    prepack: bool = True
    invariant: bool = True  # False: pieces packed with plain kernels (the invariance tax's baseline)
    logits: bool = True  # False: the last chunk skips the output head too (a settle: the next call feeds on)


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
