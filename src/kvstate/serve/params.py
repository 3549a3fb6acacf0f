"""OpenAI request parameters to ``Session.generate`` options, checked before anything runs.

The mapping (``docs/serve.md``):

* ``temperature`` 0 (or below 1e-5, as vLLM does: logits divided by less overflow) is greedy
  decoding; otherwise sampling with that temperature.
  OpenAI applies no top-k, so ``top_k`` is 0 (off) unless the request sets it;
  ``top_p`` passes through. ``top_k``, ``min_p`` and ``repetition_penalty`` are
  accepted as extra fields with transformers' meaning (as vLLM does).
* ``max_tokens`` / ``max_completion_tokens`` are ``max_new_tokens``; ``stop`` is
  ``stop_strings`` (the stop text is cut from the answer, as OpenAI does), at most
  ``--max-stop-strings`` of at most ``--max-stop-length`` characters: transformers matches
  them with a table of vocabulary x length (``kvstate.options``).
* ``logit_bias`` is ``sequence_bias`` on single tokens; ``presence_penalty`` and
  ``frequency_penalty`` are ``OpenAIPenalties``, OpenAI's formula over the tokens
  generated so far.
* ``seed`` seeds torch's generator just before the call (calls run one at a time).
* ``logprobs`` (chat: ``true`` with ``top_logprobs`` 0..20; completions: 0..5 alternatives)
  asks generate for its raw step logits (``output_logits``); ``logprobs.py`` reports them.

Everything else OpenAI defines that kvstate cannot honour exactly (``n > 1``,
``echo``, ``suffix``, ``best_of``, tools, structured output) is a 400
before any work, never silently ignored; unknown fields are a 400 as in OpenAI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import BadRequest

_COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "n", "stop", "seed", "presence_penalty",
           "frequency_penalty", "logit_bias", "logprobs", "user", "max_tokens", "top_k", "min_p",
           "repetition_penalty", "metadata", "store", "service_tier"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                         "tool_choice", "parallel_tool_calls", "reasoning_effort", "modalities"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
GREEDY_BELOW = 1e-5  # a smaller temperature overflows the scaled logits to inf, and sampling fails on NaN
# fields OpenAI defines whose non-default value kvstate refuses (value -> is it the default?)
_REFUSED = {
    "n": lambda v: v in (None, 1),
    "echo": lambda v: v in (None, False),
    "suffix": lambda v: v in (None, ""),
    "best_of": lambda v: v in (None, 1),
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "modalities": lambda v: v in (None, ["text"]),
}


@dataclass(frozen=True)
class Limits:
    """Per-request bounds: prompt tokens, new tokens (and the default when a request names none), and the stop
    strings' count and length (each character of the longest costs 4 bytes x the vocabulary in transformers'
    stop-string table: 1 MiB for a 262k vocabulary)."""

    max_prompt_tokens: int = 8192
    max_new_tokens: int = 2048
    default_max_tokens: int = 256
    max_stop_strings: int = 4  # OpenAI's own limit
    max_stop_length: int = 32  # characters


@dataclass
class Request:
    """One validated request: ``options`` for ``Session.generate`` (without the tokenizer), the
    ``stop`` strings to cut from answers, streaming flags, the seed and ``logprobs``: None (not asked)
    or how many alternatives each token's logprob comes with."""

    options: dict[str, Any]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    seed: int | None
    logprobs: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def parse(body: dict[str, Any], fields: set[str], limits: Limits, default_stop: tuple[str, ...] = (),
          default_max: int | None = None, vocab: int | None = None) -> Request:
    """Validate ``body`` (a chat or completion request) and map its sampling fields; ``vocab``: the model's
    vocabulary size, which ``logit_bias`` ids must be under."""
    unknown = sorted(set(body) - fields)
    if unknown:
        raise BadRequest(f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0])
    for name, is_default in _REFUSED.items():
        if name in body and not is_default(body[name]):
            raise BadRequest(f"{name}={body[name]!r} is not supported by kvstate serve", param=name,
                             fix=f"omit {name} (kvstate serves one sequence of plain text per request)")
    max_new = _max_tokens(body, limits, default_max)
    options: dict[str, Any] = {"max_new_tokens": max_new, **_sampling(body)}
    stop = _stop(body, default_stop, limits)
    if stop:
        options["stop_strings"] = list(stop)
    processors = _penalties(body)
    if processors:
        options["logits_processor"] = processors
    bias = _logit_bias(body.get("logit_bias"), vocab)
    if bias:
        options["sequence_bias"] = bias
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("'seed' must be an integer", param="seed")
    logprobs = _logprobs(body, chat="messages" in fields)
    if logprobs is not None:
        options.update(output_logits=True, return_dict_in_generate=True)
    return Request(options, stop, bool(body.get("stream")), bool(stream_options.get("include_usage")), seed,
                   logprobs)


def _logprobs(body: dict[str, Any], *, chat: bool) -> int | None:
    """How many alternatives to report per token, or None: chat's ``logprobs: true`` with ``top_logprobs``
    (0..20, only with ``logprobs``), or completions' ``logprobs`` (0..5), as OpenAI bounds them."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if asked is not None and not isinstance(asked, bool):
            raise BadRequest("'logprobs' must be a boolean", param="logprobs", code="invalid_value")
        _count(top, "top_logprobs", 20)
        if top and not asked:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value",
                             fix="send logprobs=true with top_logprobs, or omit top_logprobs")
        return (top or 0) if asked else None
    return None if asked is None else _count(asked, "logprobs", 5)


def _count(value: Any, name: str, high: int) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high):
        raise BadRequest(f"'{name}' must be an integer in [0, {high}]", param=name, code="invalid_value")
    return value


def _number(body: dict[str, Any], name: str, low: float, high: float, default: float | None) -> float | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number in [{low}, {high}]", param=name, code="invalid_value")
    return float(value)


def _max_tokens(body: dict[str, Any], limits: Limits, default_max: int | None) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return default_max or limits.default_max_tokens
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limits.max_new_tokens:
        raise BadRequest(f"'{name}' must be an integer in [1, {limits.max_new_tokens}]", param=name,
                         code="invalid_value", fix="ask for fewer tokens (the server's --max-new-tokens bound)")
    return value


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    top_k = body.get("top_k", 0)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1:
        raise BadRequest("'top_k' must be an integer >= 0 (0 or -1: off)", param="top_k")
    options: dict[str, Any] = {}
    if temperature < GREEDY_BELOW:
        options["do_sample"] = False
    else:
        options.update(do_sample=True, temperature=temperature, top_p=_number(body, "top_p", 0.0, 1.0, 1.0),
                       top_k=max(top_k, 0))
        if options["top_p"] == 0.0:
            raise BadRequest("'top_p' must be > 0", param="top_p", code="invalid_value")
        min_p = _number(body, "min_p", 0.0, 1.0, None)
        if min_p:
            options["min_p"] = min_p
    penalty = _number(body, "repetition_penalty", 0.01, 100.0, None)
    if penalty is not None and penalty != 1.0:
        options["repetition_penalty"] = penalty
    return options


def _stop(body: dict[str, Any], default_stop: tuple[str, ...], limits: Limits) -> tuple[str, ...]:
    if "stop" not in body:
        return default_stop
    stop = body["stop"]
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or an array of them", param="stop", code="invalid_value")
    if len(stop) > limits.max_stop_strings:
        raise BadRequest(f"'stop' holds {len(stop)} strings; this server takes at most {limits.max_stop_strings} "
                         "(its --max-stop-strings)", param="stop", code="invalid_value",
                         fix="send fewer stop strings, or start the server with a larger --max-stop-strings")
    for i, text in enumerate(stop):
        if len(text) > limits.max_stop_length:
            where = "'stop'" if isinstance(body["stop"], str) else f"'stop[{i}]'"
            raise BadRequest(f"{where} is {len(text)} characters long; this server takes stop strings of at most "
                             f"{limits.max_stop_length} characters (its --max-stop-length: matching them costs a "
                             "table of vocabulary x length)", param="stop", code="invalid_value",
                             fix="stop on a shorter string (its last characters usually suffice), or start the "
                             "server with a larger --max-stop-length")
    return tuple(stop)


def _logit_bias(bias: Any, vocab: int | None = None) -> list[list[Any]]:
    if bias is None:
        return []
    if not isinstance(bias, dict):
        raise BadRequest("'logit_bias' must map token ids to numbers in [-100, 100]", param="logit_bias")
    pairs = []
    for key, value in bias.items():
        ok = str(key).isdigit() and isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not -100 <= value <= 100:
            raise BadRequest("'logit_bias' must map token ids to numbers in [-100, 100]", param="logit_bias")
        if vocab is not None and int(key) >= vocab:
            raise BadRequest(f"'logit_bias' names token {int(key)}, outside the model's vocabulary [0, {vocab})",
                             param="logit_bias", code="invalid_value", fix="bias only ids the tokenizer produces")
        pairs.append([[int(key)], float(value)])
    return pairs


def _penalties(body: dict[str, Any]) -> list[Any]:
    presence = _number(body, "presence_penalty", -2.0, 2.0, 0.0) or 0.0
    frequency = _number(body, "frequency_penalty", -2.0, 2.0, 0.0) or 0.0
    return [OpenAIPenalties(presence, frequency)] if presence or frequency else []


class OpenAIPenalties:
    """OpenAI's penalties over the tokens generated so far: ``logit[j] -= count[j] * frequency
    + (count[j] > 0) * presence``. The prompt length is read at the first call (the first
    call sees the whole prompt and no generated token)."""

    def __init__(self, presence: float, frequency: float) -> None:
        self.presence, self.frequency = presence, frequency
        self.prompt_length: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``input_ids`` ``[B, L]`` (history + generated), ``scores`` ``[B, V]``."""
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        generated = input_ids[:, self.prompt_length:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence
