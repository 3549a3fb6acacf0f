"""The batched sampler's choices, each against its definition written apart.

The greedy choice is ``argmax``'s first maximal index (NaN and infinities included); a step's
log-probabilities are each row's own; top-k, top-p and min-p truncations and stop ids behave as
their definitions say.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate.batch import BatchRequest, Sampling, generate_many
from kvstate.batch.sampling import first_max
from kvstate.errors import InputError
from test_batch import ROWS, answered, model_in
from tiny import prompt


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(length=st.integers(1, 5000), values=st.lists(st.sampled_from([-math.inf, -3.0, 0.0, 0.5, 2.0, 7.25, math.inf,
                                                                   math.nan]), min_size=1, max_size=4),
       seed=st.integers(0, 1000), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_greedy_choice_is_argmax_first_maximal_index(length, values, seed, dtype):
    # first_max finds the maximum blockwise (argmax over 262k logits does not vectorize on this CPU); few distinct
    # values make ties across and inside blocks, NaN and infinities included
    gen = torch.Generator().manual_seed(seed)
    scores = torch.tensor(values, dtype=dtype)[torch.randint(len(values), (length,), generator=gen)]
    assert first_max(scores) == int(scores.argmax())


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(n=st.integers(1, 17), vocab=st.sampled_from([1, 37, 128, 1000, 4099, 262_144]), seed=st.integers(0, 1000),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), scale=st.sampled_from([1.0, 30.0]))
def test_a_steps_log_probabilities_are_each_rows_own(n, vocab, seed, dtype, scale):
    # a decode step takes log_softmax of all its rows in one call (rows_logprobs); each row must keep the bits
    # Sampler.choose computes from that row alone (as a prompt's first token is chosen)
    from kvstate.batch.sampling import rows_logprobs

    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=gen) * scale).to(dtype)
    rows, logprobs = rows_logprobs(logits)
    for i in range(n):
        assert torch.equal(rows[i], logits[i].float())
        assert torch.equal(logprobs[i], torch.log_softmax(logits[i].float(), dim=-1))


def test_sampling_truncations_behave_as_their_definitions():
    model = model_in("llama", torch.float32)
    ids = prompt(9, seed=5)[0]
    greedy = generate_many(model, [BatchRequest(ids, max_new_tokens=6)], rows=ROWS)[0]
    for sampling in (Sampling(temperature=1.5, top_k=1, seed=1), Sampling(temperature=1.5, top_p=1e-6, seed=2)):
        assert generate_many(model, [BatchRequest(ids, max_new_tokens=6, sampling=sampling)], rows=ROWS)[0].tokens \
            == greedy.tokens, sampling  # one candidate left: the most likely token
    draws = [generate_many(model, [BatchRequest(ids, max_new_tokens=6, sampling=Sampling(2.0, seed=seed),
                                                top_logprobs=4)], rows=ROWS)[0] for seed in (7, 7, 8)]
    assert answered(draws[0]) == answered(draws[1]) and draws[0].tokens != draws[2].tokens
    top4 = generate_many(model, [BatchRequest(ids, max_new_tokens=6, sampling=Sampling(2.0, top_k=4, seed=9),
                                              top_logprobs=4)], rows=ROWS)[0]
    for token, logprob, top in zip(top4.tokens, top4.logprobs, top4.top_logprobs, strict=True):
        assert token in [t for t, _ in top] and dict(top)[token] == logprob  # top-k draws from the k best


def test_a_stop_id_ends_the_answer():
    model = model_in("llama", torch.float32)
    free = generate_many(model, [BatchRequest(prompt(7)[0], max_new_tokens=6)])[0]
    stopped = generate_many(model, [BatchRequest(prompt(7)[0], max_new_tokens=6, stop_ids=(free.tokens[2],))])[0]
    end = free.tokens.index(free.tokens[2]) + 1
    assert stopped.tokens == free.tokens[:end] and stopped.finish_reason == "stop"


def test_min_p_draws_only_tokens_near_the_most_likely():
    """``min_p`` drops the tokens less likely than ``min_p`` times the most likely one (generate's rule,
    after top-p); out of [0, 1] it is refused."""
    from kvstate.batch.sampling import Sampler

    logits = torch.tensor([5.0, 4.9, 0.0, -1.0])  # probabilities about 0.52, 0.47, 0.004, 0.001
    sampler = Sampler(Sampling(temperature=1.0, min_p=0.5, seed=0), 0, torch.device("cpu"))
    assert {sampler.choose(logits).token for _ in range(64)} == {0, 1}
    loose = Sampler(Sampling(temperature=1.0, min_p=0.001, seed=0), 0, torch.device("cpu"))
    assert {loose.choose(logits * 0.1).token for _ in range(256)} == {0, 1, 2, 3}
    with pytest.raises(InputError, match="min_p"):
        Sampling(temperature=1.0, min_p=1.5)
