"""Token log-probabilities for ``logprobs`` / ``top_logprobs``, and their two OpenAI shapes.

What is reported is vLLM's default (``logprobs_mode="raw_logprobs"``): ``log_softmax`` of the
model's raw next-token logits in float32, before any logits processor (temperature, top-k/p,
penalties, ``logit_bias``). So a token's logprob is the model's, whatever the sampling settings,
and equals ``log_softmax`` of ``model.generate(..., output_logits=True)``'s ``logits`` (bit for bit
when plain transformers prefills in the same canonical chunks: ``tests/test_serve_logprobs.py``).

Each generated token whose text starts inside the answer is reported: the tokens after a stop
string's cut and a final end-of-sequence token (no text) are not. ``offset`` is where a token's
text starts in the answer (characters); the pieces between offsets concatenate to the answer,
which is how a stream carries them. ``-inf`` (a logit masked by the model) is sent as -9999.0,
as vLLM does: JSON has no infinity. A token's ``bytes`` are its own bytes, also for a token that
holds part of a character (whose text shows U+FFFD): SentencePiece's ``<0xHH>`` byte tokens and
GPT-2-style byte-level tokens are read from the vocabulary; any other such token has ``None``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

FLOOR = -9999.0  # JSON cannot carry -inf


@dataclass(frozen=True)
class Alternative:
    """One candidate token at a step: its text, its bytes (None: unknown) and its logprob."""

    token: str
    bytes: tuple[int, ...] | None
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its text, bytes, logprob, where its text starts in the answer, and the
    ``top`` candidates at its step (most likely first)."""

    token: str
    bytes: tuple[int, ...] | None
    logprob: float
    offset: int
    top: tuple[Alternative, ...]


Step = tuple[float, tuple[tuple[int, float], ...]]  # a token's logprob and the top (id, logprob) pairs


def step_of(logits: torch.Tensor, token: int, k: int) -> Step:
    """Token ``token``'s logprob and the ``k`` most likely ``(id, logprob)`` pairs of raw ``logits`` ``[V]``
    (``log_softmax`` in float32, as the batched scheduler's sampler computes them)."""
    scores = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(scores, k)
    return scores[token].item(), tuple(zip(ids.tolist(), values.tolist(), strict=True))


def compute(logits: tuple[torch.Tensor, ...], tokens: list[int], k: int, tokenizer: Any,
            text: str) -> tuple[TokenLogprob, ...]:
    """``logits``: generate's raw per-step logits (each ``[1, V]``), ``tokens`` the generated ids, ``k``
    the alternatives per step, ``text`` the answer as returned (cut at a stop string)."""
    return build(tokens, lambda i: step_of(logits[i][0], tokens[i], k), tokenizer, text)


def build(tokens: list[int], step: Callable[[int], Step], tokenizer: Any, text: str) -> tuple[TokenLogprob, ...]:
    """The reported tokens of an answer ``text`` made of ``tokens``; ``step(i)`` gives token ``i``'s logprob
    and its alternatives (computed only for the tokens reported). The batched scheduler computes them
    itself, with the same ``log_softmax`` of the raw float32 logits."""
    reporter = Reporter(tokenizer)
    for i, token in enumerate(tokens):
        reporter.add(token, functools.partial(step, i))
    return tuple(item for _, item in reporter.rest(text))


class Reporter:
    """An answer's reported tokens as it grows, each with its piece of text as soon as that piece is final.

    ``add`` each token as it is generated (with its step, or a function computing it); ``ready(text,
    final)`` returns the ``(piece, TokenLogprob)`` of the tokens not yet returned whose piece ends within
    the first ``final`` characters of the answer so far (text a stop string may still cut is not final);
    ``rest(text)`` the others, once the answer is complete. The pieces concatenate to the answer, and
    the items are ``build``'s.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.steps: list[Step | Callable[[], Step]] = []
        self.offsets: list[int] = []  # where each token's text starts (unclamped; never decreasing)
        self.items: list[TokenLogprob] = []
        self.decoded = ""  # the text of every token added (a streamer reads it instead of decoding again)
        self._returned = 0

    def add(self, token: int, step: Step | Callable[[], Step]) -> None:
        before = self.decoded.rstrip("\ufffd")  # a trailing partial character does not count
        self.offsets.append(max(self.offsets[-1] if self.offsets else 0, len(before)))
        self.tokens.append(token)
        self.steps.append(step)
        self.decoded = self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def ready(self, text: str, final: int) -> list[tuple[str, TokenLogprob]]:
        """Tokens whose piece ends by ``final`` (the next token's offset is known and within it)."""
        out = []
        i = self._returned
        while i + 1 < len(self.tokens) and self.offsets[i + 1] <= final and self.offsets[i] < final:
            out.append((text[self.offsets[i]:self.offsets[i + 1]], self._item(i, self.offsets[i])))
            i += 1
        self._returned = i
        return out

    def rest(self, text: str) -> list[tuple[str, TokenLogprob]]:
        """The tokens not yet returned, for the complete answer ``text`` (past it nothing is reported)."""
        limit, out = len(text), []
        offsets = [min(o, limit) for o in self.offsets] + [limit]
        for i in range(self._returned, len(self.tokens)):
            if offsets[i] >= limit:
                break
            out.append((text[offsets[i]:offsets[i + 1]], self._item(i, offsets[i])))
        self._returned = len(self.tokens)
        return out

    def _item(self, i: int, offset: int) -> TokenLogprob:
        step = self.steps[i]
        logprob, top = step() if callable(step) else step
        alternatives = tuple(Alternative(*_token(self.tokenizer, t), _finite(v)) for t, v in top)
        item = TokenLogprob(*_token(self.tokenizer, self.tokens[i]), _finite(logprob), offset, alternatives)
        self.items.append(item)
        return item


def _token(tokenizer: Any, token: int) -> tuple[str, tuple[int, ...] | None]:
    """A token's text and bytes."""
    text = tokenizer.decode([token], skip_special_tokens=False)
    if "\ufffd" not in text:
        return text, tuple(text.encode("utf-8"))
    raw = tokenizer.convert_ids_to_tokens(token) or ""
    byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", raw)
    if byte:  # SentencePiece byte fallback
        return text, (int(byte.group(1), 16),)
    table = _byte_level()
    return text, tuple(table[c] for c in raw) if raw and all(c in table for c in raw) else None


@functools.cache
def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: each byte is written as a printable character (the
    printable Latin-1 bytes as themselves, the others from U+0100 on, in order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _finite(value: float) -> float:
    return max(value, FLOOR)


def pieces(items: tuple[TokenLogprob, ...], text: str) -> list[str]:
    """The answer split at the tokens' offsets: one piece per token, concatenating to ``text``."""
    ends = [item.offset for item in items[1:]] + [len(text)]
    return [text[item.offset:end] for item, end in zip(items, ends, strict=True)]


def chat_shape(items: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``."""
    def entry(item: TokenLogprob | Alternative) -> dict[str, Any]:
        return {"token": item.token, "logprob": item.logprob, "bytes": None if item.bytes is None else list(item.bytes)}

    return {"content": [{**entry(i), "top_logprobs": [entry(a) for a in i.top]} for i in items], "refusal": None}


def completion_shape(items: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """A completion choice's ``logprobs``: parallel lists, each step's ``top_logprobs`` a map holding the top
    candidates and the chosen token (OpenAI: up to ``logprobs + 1`` entries)."""
    tops = [{**{a.token: a.logprob for a in i.top}, i.token: i.logprob} for i in items]
    return {"tokens": [i.token for i in items], "token_logprobs": [i.logprob for i in items],
            "top_logprobs": tops, "text_offset": [i.offset for i in items]}
