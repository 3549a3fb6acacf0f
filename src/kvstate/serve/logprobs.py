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


def compute(logits: tuple[torch.Tensor, ...], tokens: list[int], k: int, tokenizer: Any,
            text: str) -> tuple[TokenLogprob, ...]:
    """``logits``: generate's raw per-step logits (each ``[1, V]``), ``tokens`` the generated ids, ``k``
    the alternatives per step, ``text`` the answer as returned (cut at a stop string)."""
    def step(i: int) -> Step:
        scores = torch.log_softmax(logits[i][0].float(), dim=-1)  # [V]
        values, ids = torch.topk(scores, k)
        return scores[tokens[i]].item(), tuple(zip(ids.tolist(), values.tolist(), strict=True))

    return build(tokens, step, tokenizer, text)


def build(tokens: list[int], step: Callable[[int], Step], tokenizer: Any, text: str) -> tuple[TokenLogprob, ...]:
    """The reported tokens of an answer ``text`` made of ``tokens``; ``step(i)`` gives token ``i``'s logprob
    and its alternatives (computed only for the tokens reported). The batched scheduler computes them
    itself, with the same ``log_softmax`` of the raw float32 logits."""
    offsets = _offsets(tokenizer, tokens, len(text))
    out = []
    for i, (token, offset) in enumerate(zip(tokens, offsets, strict=True)):
        if offset >= len(text):  # past the answer: a stop string's tokens, the end token
            break
        logprob, top = step(i)
        alternatives = tuple(Alternative(*_token(tokenizer, t), _finite(v)) for t, v in top)
        out.append(TokenLogprob(*_token(tokenizer, token), _finite(logprob), offset, alternatives))
    return tuple(out)


def _offsets(tokenizer: Any, tokens: list[int], limit: int) -> list[int]:
    """Where each token's text starts: the length of the text before it (a trailing partial character,
    decoded as U+FFFD, not counted), never decreasing, at most ``limit``."""
    offsets, last = [], 0
    for i in range(len(tokens)):
        if last < limit:  # past the answer nothing is reported: no need to decode further
            before = tokenizer.decode(tokens[:i], skip_special_tokens=True).rstrip("\ufffd")
            last = min(max(last, len(before)), limit)
        offsets.append(last)
    return offsets


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
