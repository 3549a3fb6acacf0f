"""A state's schedule travels with it: a session continuing a state (loaded from a file into a fresh instance,
given as ``state=``, found in a store) uses the state's canonical chunk, marks and kernels, so the saved work is
reused; a session told another schedule says why it reuses nothing (a ``ScheduleWarning``, ``ResumePlan.note``).

The oracle for every resume is the session that made the state continuing it itself (no file, no adoption):
its answer and its reuse."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvstate import PrefixStore, Session
from kvstate.errors import ScheduleWarning
from kvstate.testing.shrink import tiny_causal_lm

TYPES = ("llama", "granite", "mamba")  # attention, another attention family, and a recurrent one (checkpoints)
OPTIONS = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)


def ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(20, 120, (1, n), generator=torch.Generator().manual_seed(seed))


def continued(session: Session, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, str]:
    out = session.generate(history, **OPTIONS)
    return out.sequences, torch.cat(out.logits), session.last_plan.reused, session.last_plan.mode


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("model_type", TYPES)
def test_a_loaded_state_continues_under_its_own_schedule_in_a_fresh_instance(model_type, chunk, tmp_path):
    model = tiny_causal_lm(model_type)
    history = ids(26)
    made = Session(model, canonical_chunk=chunk)
    made.extend(history[:, :18])
    made.save(tmp_path / "state.kvs")
    tokens, logits, reused, mode = continued(made.fork(), history)  # the oracle: the session itself
    assert reused == (18 if chunk == 0 else 16) and mode != "recompute"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ScheduleWarning)  # the defaults take the state's schedule: nothing to say
        for session in (Session.load(tmp_path / "state.kvs", tiny_causal_lm(model_type)),  # a fresh instance
                        Session(model, state=made.state)):
            assert session.canonical_chunk == chunk
            got_tokens, got_logits, got_reused, _ = continued(session, history)
            assert got_reused == reused, session.last_plan
            assert torch.equal(got_tokens, tokens) and torch.equal(got_logits, logits)


def test_a_state_told_another_schedule_says_why_its_slots_are_fed_again(tmp_path):
    model = tiny_causal_lm("llama")
    history = ids(26)
    made = Session(model, canonical_chunk=0)
    made.extend(history[:, :18])
    made.save(tmp_path / "state.kvs")
    with pytest.warns(ScheduleWarning, match="canonical_chunk=0"):
        other = Session.load(tmp_path / "state.kvs", model, canonical_chunk=4)
    cold = continued(Session(model, canonical_chunk=4), history)
    warm = continued(other, history)
    assert warm[2] == 0 and "fed off the canonical schedule" in other.last_plan.note
    assert torch.equal(warm[0], cold[0]) and torch.equal(warm[1], cold[1])  # nothing reused: the cold answer


def test_a_store_hit_of_another_schedule_is_not_reused_and_the_plan_says_why(tmp_path):
    model = tiny_causal_lm("llama")
    history = ids(40, seed=1)
    writer = Session(model, canonical_chunk=0, store=PrefixStore(tmp_path / "store", chunk_tokens=8))
    writer.generate(history[:, :33], max_new_tokens=1, do_sample=False)
    same = Session(model, canonical_chunk=0, store=PrefixStore(tmp_path / "store", chunk_tokens=8))
    same.generate(history, max_new_tokens=1, do_sample=False)
    assert same.last_plan.source == "store" and same.last_plan.reused >= 32
    other = Session(model, store=PrefixStore(tmp_path / "store", chunk_tokens=8))  # C = 64 on a CPU
    other.generate(history, max_new_tokens=1, do_sample=False)
    assert other.last_plan.reused == 0 and other.last_plan.note.startswith("store: ")
    assert "canonical_chunk=0" in other.last_plan.note
