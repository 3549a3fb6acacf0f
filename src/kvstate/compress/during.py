"""Compression during ``generate``: a long decode that never holds more than a slot budget (issue 16).

``Session.generate(history, compress=policy, budget=B, every=N, ...)`` decodes in
rounds of ``N`` tokens through the ordinary ``generate`` engine run: before each
round the state is compressed to ``B - N`` slots per attention layer, so the round's
``N`` tokens fit within ``B``. The prompt is fed whole first. Each round starts from
stored logits, so the tokens are exactly those of ``decode_with_budget`` (the manual
reference), and every round's options, processors and stopping criteria are
``model.generate``'s own. Nothing is committed until the last round ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..errors import InputError, UnsupportedError
from ..options import GenerateOptions
from ..state import State
from .apply import check_budget
from .policies import Policy

# options whose meaning spans the whole call, which rounds of generate cannot keep: generate()
# arguments, then GenerationConfig fields (set by keyword, generation_config= or the model's own)
_REFUSED_ARGS = {
    "streamer": "a streamer would see the prompt again every round",
    "stopping_criteria": "a criterion that fires on a round's last token cannot be told from the round's end",
}
_REFUSED_FIELDS = {
    "min_new_tokens": "a minimum length spans rounds",
    "min_length": "a minimum length spans rounds",
    "max_time": "a time limit spans rounds",
    "stop_strings": "a criterion that fires on a round's last token cannot be told from the round's end",
    "return_dict_in_generate": "outputs span rounds; take the returned token ids",
}
COMPRESS_KEYS = ("compress", "budget", "every")


def split_options(kwargs: dict[str, Any]) -> tuple[Policy, int, int] | None:
    """Remove and check ``compress=``, ``budget=``, ``every=`` from ``generate`` keywords; None if absent."""
    given = {k: kwargs.pop(k) for k in COMPRESS_KEYS if k in kwargs}
    if not given:
        return None
    policy = given.get("compress")
    if not isinstance(policy, Policy):
        raise InputError("generate(compress=...) takes a policy", expected="e.g. compress=KVzip(), budget=256, "
                         "every=32", found=type(policy).__name__, fix="pass compress, budget and every together")
    budget, every = given.get("budget"), given.get("every", 32)
    check_budget(budget, every, policy)
    return policy, budget, every  # type: ignore[return-value]


def plan_rounds(options: GenerateOptions, prompt_length: int) -> tuple[int, set[int]]:
    """How many tokens the whole call may generate and which ids end it, from the config
    ``generate`` resolved; options that rounds cannot keep are refused here, before anything runs."""
    config = options.config
    found = [k for k in _REFUSED_ARGS if options.kwargs.get(k) is not None]
    found += [k for k in _REFUSED_FIELDS if getattr(config, k, None) not in (None, 0, False)]
    if found:
        why = "; ".join(f"{k}: {_REFUSED_ARGS.get(k) or _REFUSED_FIELDS[k]}" for k in found)
        raise UnsupportedError(f"not supported with compress=: {why}", found=found,
                               fix="drop these options, or generate without compress")
    eos = config.eos_token_id
    ends = set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
    if config.max_new_tokens is not None:
        return int(config.max_new_tokens), ends
    return max(int(config.max_length) - prompt_length, 0), ends


def generate_within(state: State, history: torch.Tensor, options: GenerateOptions, *, budget: int, every: int,
                    total: int, ends: set[int], compress: Callable[[State, int], State], generate: Callable[..., Any],
                    feed: Callable[[State, torch.Tensor], State]) -> tuple[State, torch.Tensor]:
    """Rounds of ``generate`` on ``state`` (which has processed ``history`` ``[1, L]`` and holds its
    last logits); returns the state after the last round and the new tokens ``[1, N]``."""
    out: list[torch.Tensor] = []
    left = total
    while left > 0:
        state = compress(state, budget - every)
        n = min(every, left)
        kwargs = {k: v for k, v in options.kwargs.items() if k != "max_length"}
        round_options = replace(options, kwargs={**kwargs, "max_new_tokens": n})
        done = generate(state, history, round_options)
        tokens = done.tokens
        out.append(tokens)
        history = torch.cat([history, tokens], dim=1)
        left -= tokens.shape[1]
        state = done.state
        if tokens.shape[1] < n or left == 0 or int(tokens[0, -1]) in ends:  # done, or an end-of-sequence id
            break
        state = feed(state, tokens[:, -1:])
    new = torch.cat(out, dim=1) if out else history[:, :0]
    return state, new
