"""One answer's tokens, turned into final text as they come: the server's streamer.

``Streamer.add(token, step)`` takes each new token with its step (its logprob and top alternatives; None
where none came), from the scheduler's sampler or, for a request run alone, from ``generate``'s streamer
protocol (``GenerateStream``). Text goes out once it is final: an incomplete character and any tail that
may still become a stop string are held back, and the answer is cut at the first stop. With ``logprobs``
each token's piece goes out with its logprobs (``logprobs.Reporter``). A cancelled job (the client went
away) raises ``Cancelled`` at its next token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .logprobs import Reporter, Step, TokenLogprob, step_of

if TYPE_CHECKING:
    from .metrics import Metrics
    from .runner import Job


class Cancelled(Exception):
    """The client disconnected; the job stops without committing anything."""


class Streamer:
    """The text of one job's answer, as it becomes final (see the module docstring)."""

    def __init__(self, tokenizer: Any, job: Job, metrics: Metrics | None = None) -> None:
        self.tokenizer, self.job, self.metrics = tokenizer, job, metrics
        self.stop = job.request.stop
        self.tokens: list[int] = []
        self.sent = 0
        self._decoded: tuple[int, str, bool] = (0, "", False)  # (tokens, text, stopped) of the last decode
        self.k = job.request.logprobs
        self.reporter = None if self.k is None else Reporter(tokenizer)
        self.complete = self.k is not None  # every token came with its step

    def add(self, token: int, step: Step | None) -> None:
        """The answer's next token and its step; sends the text (or pieces with logprobs) now final."""
        if self.job.cancelled.is_set():
            raise Cancelled
        if not self.tokens and self.metrics is not None:
            self.metrics.first_token(self.job.clock)
        if self.reporter is not None and self.complete:
            if step is None:
                self.complete = False
            else:
                self.reporter.add(token, step)
        self.tokens.append(token)
        if self.job.on_text is None and self.job.on_token is None:
            return
        text, stopped = self._text(self.tokens)
        ready = len(text) if stopped else len(text) - self._held(text)
        if self.job.on_token is not None and self.reporter is not None and self.complete:
            for piece, item in self.reporter.ready(text, ready):
                self.job.on_token(piece, item)
        elif self.job.on_text is not None and ready > self.sent:
            self.job.on_text(text[self.sent:ready])
            self.sent = ready

    def final(self, tokens: list[int]) -> tuple[str, bool]:
        """The whole answer (cut at a stop string, and whether one was found); sends what is left."""
        text, stopped = self._text(tokens)
        if self.reporter is not None and self.complete and tokens == self.tokens:
            rest = self.reporter.rest(text)
            if self.job.on_token is not None:
                for piece, item in rest:
                    self.job.on_token(piece, item)
        else:
            self.complete = False
        if self.job.on_text is not None and len(text) > self.sent:
            self.job.on_text(text[self.sent:])
        return text, stopped

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The reported tokens, once ``final`` ran with every step (None without logprobs)."""
        return None if self.reporter is None else tuple(self.reporter.items)

    @property
    def stopped(self) -> bool:
        """Whether the answer so far holds a stop string (decoded once per token, whoever asks)."""
        return bool(self.stop) and self._text(self.tokens)[1]

    def _text(self, tokens: list[int]) -> tuple[str, bool]:
        if self._decoded[0] == len(tokens) and tokens is self.tokens:
            return self._decoded[1:]  # type: ignore[return-value]
        reporter = self.reporter
        shared = reporter is not None and self.complete and tokens == reporter.tokens
        text = reporter.decoded if shared else self.tokenizer.decode(tokens, skip_special_tokens=True)  # type: ignore[union-attr]
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        text, stopped = (text[:min(cuts)], True) if cuts else (text, False)
        if tokens is self.tokens:
            self._decoded = (len(tokens), text, stopped)
        return text, stopped

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` not yet final: a partial UTF-8 character (U+FFFD for each byte token
        so far), or a stop string's start."""
        held = len(text) - len(text.rstrip("\ufffd"))  # a character split over 3 or 4 byte tokens shows several
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    held = max(held, k)
                    break
        return held


class GenerateStream:
    """transformers' streamer protocol over a ``Streamer``, for a request ``Session.generate`` runs: the echoed
    history is skipped, and each token goes in with the step of the raw logits ``[1, V]`` the engine hands
    first (``put_logits``; computed now: holding each step's logits would cost V floats a token)."""

    def __init__(self, streamer: Streamer) -> None:
        self.streamer = streamer
        self._history_seen = False
        self._logits: torch.Tensor | None = None

    def put_logits(self, logits: torch.Tensor | None) -> None:
        self._logits = None if logits is None else logits[0]

    def put(self, value: torch.Tensor) -> None:
        if self.streamer.job.cancelled.is_set():
            raise Cancelled
        if not self._history_seen:  # generate echoes the history first
            self._history_seen = True
            return
        new = value.reshape(-1).tolist()
        logits, self._logits = self._logits, None
        k = self.streamer.k
        for token in new:
            one = logits is not None and len(new) == 1 and k is not None
            self.streamer.add(token, step_of(logits, token, k) if one else None)  # type: ignore[arg-type]

    def end(self) -> None:
        """Nothing here: ``Streamer.final`` sends the rest once the state is committed."""
