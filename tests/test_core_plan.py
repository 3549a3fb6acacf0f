"""The resume planner on toy states: pure, and it keeps the longest prefix the layers can reach.

No model is involved. Hypothesis draws states of full, sliding and recurrent layers
(with checkpoints at random lengths) and histories that share a random prefix with
them; every plan must keep exactly the longest prefix that (a) the history shares,
(b) leaves at least one token to feed (unless the history is fully processed and the
state holds its logits), (c) splits no media span, and (d) every layer can return to.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate import State
from kvstate.layers import AttentionLayerState, RecurrentLayerState
from kvstate.resume import common_prefix, plan, safe_point, start_state
from kvstate.state import Checkpoint
from tiny import assert_same_state, snapshot


def attention(T: int, window: int | None, reserve: int) -> AttentionLayerState:
    keep = T if window is None else min(T, window - 1 + reserve)
    if keep == 0:
        return AttentionLayerState(None, None, None, T, window, reserve)
    kv = torch.zeros(1, 1, keep, 1)
    return AttentionLayerState(kv, kv, torch.arange(T - keep, T)[None], T, window, reserve)


@st.composite
def toy_states(draw):
    T = draw(st.integers(0, 14))
    tokens = draw(st.lists(st.integers(0, 2), min_size=T, max_size=T))
    kinds = draw(st.lists(st.sampled_from(["full", "sliding", "recurrent"]), min_size=1, max_size=3))
    layers = []
    for kind in kinds:
        if kind == "recurrent":
            layers.append(RecurrentLayerState({0: torch.zeros(1, 1, 2)}, {0: torch.zeros(1, 1)}, T))
        else:
            window = draw(st.integers(2, 6)) if kind == "sliding" else None
            layers.append(attention(T, window, draw(st.integers(0, 3)) if window else 0))
    recurrent = {i: x for i, x in enumerate(layers) if x.checkpointed}
    marks = sorted(set(draw(st.lists(st.integers(0, T), max_size=3)))) if recurrent else []
    checkpoints = tuple(Checkpoint(n, MappingProxyType({i: RecurrentLayerState(x.conv, x.recurrent, n)
                                                         for i, x in recurrent.items()})) for n in marks)
    logits = torch.zeros(1, 3) if draw(st.booleans()) and T else None
    return State(tokens=torch.tensor([tokens], dtype=torch.long).reshape(1, T),
                 mask=torch.ones(1, T, dtype=torch.bool), positions=torch.arange(T)[None],
                 layers=tuple(layers), next_position=torch.tensor([T]), last_logits=logits, checkpoints=checkpoints)


@st.composite
def requests(draw, state):
    shared = draw(st.integers(0, state.tokens_seen))
    rest = draw(st.lists(st.integers(0, 2), max_size=8))
    history = state.tokens[0, :shared].tolist() + rest
    if not history:
        history = [0]
    L = len(history)
    spans = draw(st.lists(st.tuples(st.integers(0, L - 1), st.integers(2, 4)), max_size=2))
    return torch.tensor([history]), tuple((a, min(a + n, L)) for a, n in spans)  # [start, end) media items


def reachable(state: State, n: int) -> bool:
    return not state.rollback_limit(n)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_plan_keeps_the_longest_reachable_prefix(data):
    state = data.draw(toy_states())
    ids, spans = data.draw(requests(state))
    mask = torch.ones_like(ids, dtype=torch.bool)
    before = snapshot(state)
    p = plan(state, ids, mask, spans)
    assert_same_state(state, before)  # planning changes nothing
    T, L = state.tokens_seen, ids.shape[1]
    shared = safe_point(common_prefix(state, ids, mask), spans)
    assert p.fed == L - p.reused and p.source == "state"
    if p.mode == "stored-logits":
        assert shared == T == L and state.last_logits is not None and p.reused == L
        return
    assert p.reused <= min(shared, L - 1) and safe_point(p.reused, spans) == p.reused
    candidates = [n for n in range(min(shared, L - 1) + 1) if safe_point(n, spans) == n and reachable(state, n)]
    assert p.reused == max(candidates, default=0), (p, candidates)
    start = start_state(state, p, State.empty(state.layers))
    assert start.tokens.tolist()[0] == ids[0, :p.reused].tolist()
    if p.reused == T:
        assert p.mode == "continue"
    elif p.mode == "recompute":
        assert p.reused == 0 and not reachable(state, 0)
    else:
        assert p.mode in ("rollback", "checkpoint")


def test_stored_logits_only_when_the_whole_history_is_processed():
    state = State(tokens=torch.tensor([[1, 2, 3]]), mask=torch.ones(1, 3, dtype=torch.bool),
                  positions=torch.arange(3)[None], layers=(attention(3, None, 0),),
                  next_position=torch.tensor([3]), last_logits=torch.zeros(1, 4))
    ones = torch.ones(1, 3, dtype=torch.bool)
    assert plan(state, torch.tensor([[1, 2, 3]]), ones).mode == "stored-logits"
    assert plan(state.truncated(3), torch.tensor([[1, 2, 3]]), ones).mode == "stored-logits"
    cut = plan(state, torch.tensor([[1, 2, 4]]), ones)
    assert (cut.reused, cut.fed, cut.mode) == (2, 1, "rollback")
    longer = plan(state, torch.tensor([[1, 2, 3, 4]]), torch.ones(1, 4, dtype=torch.bool))
    assert (longer.reused, longer.fed, longer.mode) == (3, 1, "continue")


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_plan_never_reuses_media_whose_content_changed(data):
    """Media items the state processed are compared by content; the reused prefix ends
    before the first one that differs (or that the state holds no record of), and never splits one."""
    from dataclasses import replace

    from kvstate.state import MediaItem

    state = data.draw(toy_states())
    ids, _ = data.draw(requests(state))
    T, L = state.tokens_seen, ids.shape[1]
    starts = sorted(set(data.draw(st.lists(st.integers(0, max(min(T, L) - 2, 0)), max_size=3))))
    nexts = [*starts[1:], None] if starts else []
    held = tuple(MediaItem(a, a + 2, data.draw(st.sampled_from("ab")))
                 for a, b in zip(starts, nexts, strict=True) if a + 2 <= T and (b is None or a + 2 <= b))
    state = replace(state, media=held)
    asked = tuple(MediaItem(m.start, m.end, data.draw(st.sampled_from("ab"))) for m in held
                  if m.end <= L and data.draw(st.booleans()))
    mask = torch.ones_like(ids, dtype=torch.bool)
    p = plan(state, ids, mask, media=asked)
    changed = [m.start for m in asked if m.key not in {h.key for h in held}]
    if changed:
        assert p.reused <= min(changed)
    for m in (*held, *asked):
        assert not m.start < p.reused < m.end  # never inside an item
    assert plan(state, ids, mask, media=None).reused >= p.reused  # without pixels, placeholders are trusted
