"""Choosing each request's next token from its own logits row, with its own generator.

Everything here sees one request's logits ``[V]`` only, so a token and its log-probabilities depend on that
row and the request's ``torch.Generator`` alone: a seeded request draws the same tokens served alone or in any
batch. The draw is ``generate``'s: the request's logits processors (``logit_bias``, penalties: transformers' own
classes or any callable of ``generate``'s signature) on its row and its own ids, then transformers' temperature,
top-k, top-p and min-p warpers in ``generate``'s order, then ``torch.multinomial`` over the softmax; with the
generator seeded by the request's seed, that is the token ``torch.manual_seed(seed); model.generate(...)``
draws from the same logits. Log-probabilities are those of the model's distribution (``log_softmax`` of the
raw logits in float32), before processors, temperature and truncation, as OpenAI's ``logprobs`` report them.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import InputError


@dataclass(frozen=True)
class Sampling:
    """How a request picks tokens: ``temperature`` 0 is greedy; otherwise softmax sampling at that
    temperature over the ``top_k`` most likely tokens (0: all) within nucleus ``top_p``, without the
    tokens less likely than ``min_p`` times the most likely one (0: off; in ``generate``'s order), drawn
    from a generator seeded with ``seed`` (None: a fresh random seed, so the draw is not reproducible)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0

    def __post_init__(self) -> None:
        rules = (("temperature", self.temperature, math.isfinite(self.temperature) and self.temperature >= 0, ">= 0"),
                 ("top_k", self.top_k, isinstance(self.top_k, int) and self.top_k >= 0, "an int >= 0"),
                 ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]"),
                 ("min_p", self.min_p, 0 <= self.min_p <= 1, "in [0, 1]"))
        for name, value, ok, rule in rules:
            if not ok:
                raise InputError(f"Sampling.{name} out of range", expected=rule, found=repr(value),
                                 fix=f"pass {name} {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Choice:
    """One chosen token, its log-probability, and the ``top`` most likely ``(token, logprob)`` pairs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # a logits processor: (ids [1, L], scores [1, V])


BLOCK = 1024  # first_max's block: 256 block maxima for the default model's 262,144 logits


def first_max(scores: torch.Tensor) -> int:
    """``int(scores.argmax())`` for ``scores`` ``[V]`` (the first maximal index, generate's greedy choice) in
    vectorized passes: the maximum, the first block of ``BLOCK`` holding it, then that block's argmax.
    An index-tracking reduction over a large vocabulary does not vectorize on the CPU; ``amax`` does
    (docs/benchmarks.md)."""
    blocks = scores.shape[-1] // BLOCK
    top = scores.amax()
    if blocks < 2 or bool(top.isnan()):  # argmax takes NaN as the maximum; amax's blocks would not find it
        return int(scores.argmax())
    hit = scores[:blocks * BLOCK].view(blocks, BLOCK).amax(1) == top
    if not bool(hit.any()):
        return blocks * BLOCK + int(scores[blocks * BLOCK:].argmax())
    block = int(hit.byte().argmax())
    return block * BLOCK + int(scores[block * BLOCK:(block + 1) * BLOCK].argmax())


def rows_logprobs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[n, V]`` in float32 and their ``log_softmax``, for ``Sampler.choose`` row by row: one call
    for a step's rows instead of one per row (the kernel computes each row alone, so row ``i`` has the bits
    ``choose`` computes from ``logits[i]``; ``tests/test_batch_sampling.py`` checks it)."""
    rows = logits.float()
    return rows, torch.log_softmax(rows, dim=-1)


class Sampler:
    """One request's token choices (see the module docstring)."""

    def __init__(self, sampling: Sampling, top_logprobs: int, device: torch.device,
                 processors: Sequence[Processor] = (), history: Sequence[int] = ()) -> None:
        self.sampling, self.top_logprobs, self.processors = sampling, top_logprobs, tuple(processors)
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)  # torch.seed() would reseed
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.history = list(history)  # with processors: the request's ids and its tokens so far (what they read)
        self.device = device
        self.warpers = [] if sampling.greedy else warpers(sampling)

    def choose(self, logits: torch.Tensor, logprobs: torch.Tensor | None = None) -> Choice:
        """The next token for ``logits`` ``[V]``; ``logprobs``: their ``log_softmax`` in float32 where the caller
        computed it for many rows at once (``rows_logprobs``)."""
        row = logits.float()  # exact for bf16 / fp16: the same maxima and ties
        logprobs = torch.log_softmax(row, dim=-1) if logprobs is None else logprobs
        scores = self._processed(row)
        token = first_max(scores) if self.sampling.greedy else self._draw(scores)
        top: tuple[tuple[int, float], ...] = ()
        if self.top_logprobs:
            values, ids = logprobs.topk(min(self.top_logprobs, logprobs.shape[-1]))
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        if self.processors:
            self.history.append(token)
        return Choice(token, float(logprobs[token]), top)

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` after the request's processors, as ``generate`` runs them: float32 scores ``[1, V]``
        and the ids so far ``[1, L]``, in order (before temperature, top-k and top-p)."""
        if not self.processors:
            return logits
        ids = torch.tensor([self.history], dtype=torch.long, device=self.device)
        scores = logits.float()[None]
        for processor in self.processors:
            scores = processor(ids, scores)
        return scores[0]

    def _draw(self, scores: torch.Tensor) -> int:
        """``generate``'s sampled token: its warpers on ``scores`` ``[1, V]`` (a request's ids are not read by
        them), the softmax, one ``multinomial`` draw from the request's generator."""
        scores = scores[None]
        for warper in self.warpers:
            scores = warper(None, scores)  # type: ignore[arg-type]
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, num_samples=1, generator=self.generator))


def warpers(sampling: Sampling) -> list[Processor]:
    """transformers' warpers ``generate`` builds for ``sampling`` (``_get_logits_processor``): temperature (unless
    1), top-k (unless 0), top-p (below 1), min-p (unless 0), in that order."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out: list[Processor] = []
    if sampling.temperature != 1.0:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        out.append(TopKLogitsWarper(top_k=sampling.top_k))
    if sampling.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=sampling.top_p))
    if sampling.min_p:
        out.append(MinPLogitsWarper(min_p=sampling.min_p))
    return out
