"""Compression during ``generate``: the options ``compress=policy, budget=B, every=N`` (KV compression).

This module validates them into a ``Budget`` before anything runs, refusing options
whose meaning spans rounds; the engine's budgeted schedule (``kvstate.engine.budgeted``)
runs the rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from ..errors import InputError, UnsupportedError
from ..options import GenerateOptions, end_ids
from ..protocols import AttentionObserver
from ..state import State
from .apply import compress_state
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


@dataclass(frozen=True)
class Budget:
    """A budgeted decode: ``policy`` compresses to ``budget - every`` slots before each round of ``every``
    tokens; ``max_new_tokens`` (else up to ``max_length`` in all) at most, ending early on an id of ``ends``."""

    policy: Policy
    budget: int
    every: int
    max_new_tokens: int | None = None
    max_length: int = 0
    ends: frozenset[int] = frozenset()

    def total_after(self, prompt_length: int) -> int:
        """How many tokens the whole call may generate after a prompt of ``prompt_length`` tokens."""
        total = self.max_new_tokens if self.max_new_tokens is not None else self.max_length - prompt_length
        return max(int(total), 0)

    def compress_to(self, observer: AttentionObserver, model: torch.nn.Module, state: State, slots: int) -> State:
        """``state`` with at most ``slots`` per attention layer, by ``policy`` (the budgeted schedule's step)."""
        return compress_state(observer, model, state, self.policy, budget=slots)


def split_options(kwargs: dict[str, Any]) -> Budget | None:
    """Remove and check ``compress=``, ``budget=``, ``every=`` from ``generate`` keywords; None if absent.
    The limits and ``ends`` are filled in by ``plan_rounds`` once the options are resolved."""
    given = {k: kwargs.pop(k) for k in COMPRESS_KEYS if k in kwargs}
    if not given:
        return None
    policy = given.get("compress")
    if not isinstance(policy, Policy):
        raise InputError("generate(compress=...) takes a policy", expected="e.g. compress=KVzip(), budget=256, "
                         "every=32", found=type(policy).__name__, fix="pass compress, budget and every together")
    budget, every = given.get("budget"), given.get("every", 32)
    check_budget(budget, every, policy)
    return Budget(policy, budget, every)  # type: ignore[arg-type]


def plan_rounds(budget: Budget, options: GenerateOptions) -> Budget:
    """``budget`` with how many tokens the whole call may generate and which ids end it, from the config
    ``generate`` resolved; options that rounds cannot keep are refused here, before anything runs."""
    config = options.config
    found = [k for k in _REFUSED_ARGS if options.kwargs.get(k) is not None]
    found += [k for k in _REFUSED_FIELDS if getattr(config, k, None) not in (None, 0, False)]
    if found:
        why = "; ".join(f"{k}: {_REFUSED_ARGS.get(k) or _REFUSED_FIELDS[k]}" for k in found)
        raise UnsupportedError(f"not supported with compress=: {why}", found=found,
                               fix="drop these options, or generate without compress")
    return replace(budget, max_new_tokens=config.max_new_tokens, max_length=int(config.max_length or 0),
                   ends=end_ids(config))


class Decoder(Protocol):
    """What budgeted decoding needs of a session (``kvstate.Session`` has it)."""

    @property
    def state(self) -> State: ...
    def extend(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    def compress(self, policy: Policy, *, budget: int | None = None) -> None: ...


def decode_with_budget(session: Decoder, input_ids: torch.Tensor, policy: Policy, *, budget: int, every: int,
                       max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding on at most ``budget`` slots per attention layer, by hand (the reference for
    ``Session.generate(..., compress=policy, budget=B, every=N)``).

    The prompt is fed whole; then every ``every`` new tokens the state is compressed to
    ``budget - every`` slots, so the next ``every`` tokens fit. Returns the new tokens
    ``[B, N]``. Retained slots keep their true positions, so every step is exactly
    "attention restricted to the retained slots".
    """
    check_budget(budget, every, policy)
    logits = session.extend(input_ids)
    out = []
    for step in range(max_new_tokens):
        if step % every == 0:
            session.compress(policy, budget=budget - every)
        out.append(logits.argmax(-1, keepdim=True))
        if step + 1 < max_new_tokens:
            logits = session.extend(out[-1])
    return torch.cat(out, dim=1)


def check_budget(budget: object, every: object, policy: Policy) -> None:
    """Budgeted decoding settings, checked before anything runs."""
    if any(isinstance(v, bool) or not isinstance(v, int) for v in (budget, every)) or not 1 <= every < budget:  # type: ignore[operator]
        raise InputError("invalid decoding budget", expected="ints with 1 <= every < budget",
                         found={"budget": budget, "every": every},
                         fix="budget is the most slots a layer may hold; every new tokens it is compressed to "
                         "budget - every")
    rerun = policy.needs().rerun
    if rerun > every:  # type: ignore[operator]
        # a compressed layer cannot roll back past its compression: only the `every` tokens since can re-run
        raise InputError(f"{type(policy).__name__} re-runs its last {rerun} tokens, more than are fed between "
                         "compressions", expected=f"every >= {rerun}", found={"every": every},
                         fix=f"pass every={rerun} or more, or a policy with a smaller window")
