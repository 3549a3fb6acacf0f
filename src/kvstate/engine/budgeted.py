"""The budgeted schedule: a long decode that never holds more than a slot budget (KV compression).

``Session.generate(history, compress=policy, budget=B, every=N, ...)`` decodes in
rounds of ``N`` tokens through the ordinary ``generate`` run: before each round the
state is compressed to ``B - N`` slots per attention layer (by the policy, which asks
this engine to observe), so the round's ``N`` tokens fit within ``B``. The prompt is fed
whole first. Each round starts from stored logits, so the tokens are exactly those of
``decode_with_budget`` (the manual reference), and every round's options, processors and
stopping criteria are ``model.generate``'s own. The caller commits only the final state.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

import torch

from ..request import Feed
from ..settings import Settings
from ..state import State
from .values import Outcome, finish_reasons

if TYPE_CHECKING:
    from ..options import GenerateOptions
    from ..protocols import AttentionListener, ModelInputs
    from ..request import Request


class Engine(Protocol):
    """What the rounds need of the engine (``kvstate.engine.core.Engine``): feeds, generate runs, and
    the attention watch a policy scores with."""

    model: torch.nn.Module

    def feed(self, state: State, feed: Feed, settings: Settings) -> State: ...
    def feed_for(self, state: State, ids: torch.Tensor, mask: torch.Tensor, inputs: ModelInputs) -> Feed: ...
    def generate(self, start: State, feed: Feed | None, history: torch.Tensor, mask: torch.Tensor,
                 options: GenerateOptions, settings: Settings) -> tuple[State, State, torch.Tensor, object]: ...
    def observe(self, state: State, ids: torch.Tensor, listener: AttentionListener, *, rerun: int = 0,
                chunk_size: int = 512) -> None: ...


def run_budgeted(engine: Engine, start: State, feed: Feed | None, request: Request, settings: Settings,
                 reused: int) -> Outcome:
    """Rounds of ``generate`` from ``start`` plus ``feed`` (see the module docstring)."""
    budget = request.budget
    assert budget is not None  # run() dispatches here only with a budget
    history, options = request.ids, request.options
    prefilled = start if feed is None else engine.feed(start, feed, settings)
    state, out, left = prefilled, [], budget.total_after(history.shape[1])
    while left > 0:
        state = budget.compress_to(engine, engine.model, state, budget.budget - budget.every)
        n = min(budget.every, left)
        kwargs = {k: v for k, v in options.kwargs.items() if k != "max_length"}
        round_options = replace(options, kwargs={**kwargs, "max_new_tokens": n})
        ones = torch.ones_like(history, dtype=torch.bool)
        state, _, tokens, _ = engine.generate(state, None, history, ones, round_options, settings)
        out.append(tokens)
        history = torch.cat([history, tokens], dim=1)
        left -= tokens.shape[1]
        if tokens.shape[1] < n or left == 0 or int(tokens[0, -1]) in budget.ends:  # done, or an end id
            break
        state = _one_more(engine, state, tokens[:, -1:], settings)
    new = torch.cat(out, dim=1) if out else history[:, :0]
    return Outcome(state, prefilled, new, new, reused, finish_reasons(new, options, request.ids.shape[1]))


def _one_more(engine: Engine, state: State, token: torch.Tensor, settings: Settings) -> State:
    """``state`` after feeding the round's last token ``[1, 1]`` (the next round starts from its logits)."""
    ones = torch.ones(1, state.tokens_seen + 1, dtype=torch.bool, device=token.device)
    return engine.feed(state, engine.feed_for(state, token, ones, {}), settings)
