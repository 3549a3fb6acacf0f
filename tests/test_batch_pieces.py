"""Prompts admitted under a prefill budget, and long histories fed in pieces between the running streams' steps.

Each answer equals its answer alone (``generate_many``, one request at a time) or a cold ``Session``
bitwise: a burst admitted over several steps, a short prompt admitted while a long history is still
being fed, a history past the generation config's ``max_length``, turn marks and a diverging state as
one run follows them, a cancellation between pieces leaving nothing behind, a compressed state
continued in one run, and pieces that start from the longest prefix a source holds.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvstate import Session
from kvstate.batch import BatchRequest, Done, Scheduler, Token, batch_settings, generate_many
from test_batch import ROWS, answered, model_in
from tiny import assert_same_state, prompt, tiny_model


def test_a_prefill_budget_admits_a_burst_over_several_steps():
    model = model_in("llama", torch.float32)
    requests = [BatchRequest(prompt(10, seed=i)[0], max_new_tokens=5) for i in range(4)]
    scheduler = Scheduler(model, batch_settings(model, rows=ROWS, prefill_tokens=15))
    handles = [scheduler.submit(r) for r in requests]
    running = []
    events = []
    while scheduler.busy:
        events += scheduler.step()
        running.append(scheduler.running)
    assert running[:2] == [2, 4]  # 10 + 10 prompt tokens reach the budget of 15: two a step
    done = {e.handle: e.completion for e in events if isinstance(e, Done)}
    assert [answered(done[h]) for h in handles] == [answered(c) for c in generate_many(model, requests, rows=ROWS)]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_a_long_history_is_fed_in_pieces_between_the_running_streams_steps(arch):
    """prefill_tokens bounds a step's prefill for one long history too: it is fed up to cuts of the schedule
    over several steps, the running streams take a token at every one of them, and its answer, state and
    reused slots are those of a whole prefill (the same forwards, at other times)."""
    model = model_in(arch, torch.float32)
    settings = {"rows": ROWS, "canonical_chunk": 8}
    short = [BatchRequest(prompt(3, seed=i)[0], max_new_tokens=14) for i in range(2)]
    long = BatchRequest(prompt(61, seed=7)[0], max_new_tokens=4, top_logprobs=2)
    scheduler = Scheduler(model, batch_settings(model, prefill_tokens=12, **settings))
    handles = [scheduler.submit(r) for r in short]
    scheduler.step()
    late = scheduler.submit(long)
    waited = 0
    done = {}
    while late not in done:
        events = scheduler.step()
        done |= {e.handle: e.completion for e in events if isinstance(e, Done)}
        firsts = [e for e in events if isinstance(e, Token) and e.handle == late]
        assert {e.handle for e in events if isinstance(e, Token)} >= set(handles), "a running stream waited"
        waited += not firsts
    assert waited >= 4  # 61 tokens at about 12 a step (cuts every 8)
    done |= {e.handle: e.completion for e in scheduler.run() if isinstance(e, Done)}
    alone = generate_many(model, [long], **settings)[0]
    assert answered(done[late]) == answered(alone) and done[late].reused == alone.reused == 0
    assert_same_state(done[late].prefilled, alone.prefilled)
    cold = Session(model, canonical_chunk=8, prefill_rows=32)  # the scheduler's prefill tile (its default)
    cold.generate(long.ids[None], max_new_tokens=1, do_sample=False)
    # a generate's state keeps its own checkpoints (recurrent layers); every slot and logit is the same
    assert_same_state(replace(done[late].prefilled, checkpoints=()), replace(cold.state, checkpoints=()))
    for handle, request in zip(handles, short, strict=True):
        assert answered(done[handle]) == answered(generate_many(model, [request], **settings)[0])


def test_a_short_prompt_is_admitted_while_a_long_history_is_still_being_fed():
    """Waiting prompts go first and a history being fed gets at least one piece a step: a short prompt sent
    after a long one answers before the long one's first token, and every answer is its answer alone."""
    model = model_in("llama", torch.float32)
    settings = {"rows": ROWS, "canonical_chunk": 8}
    long, short = BatchRequest(prompt(80, seed=1)[0], max_new_tokens=3), BatchRequest(prompt(5, seed=2)[0],
                                                                                       max_new_tokens=3)
    # two chunks of 8 a step: the long one fills it
    scheduler = Scheduler(model, batch_settings(model, prefill_tokens=16, **settings))
    first = scheduler.submit(long)
    assert scheduler.step() == []  # its first piece
    second = scheduler.submit(short)
    events = list(scheduler.run())
    order = [e.handle for e in events if isinstance(e, Token)]
    assert order.index(second) < order.index(first), order
    got = {e.handle: e.completion for e in events if isinstance(e, Done)}
    for handle, request in ((first, long), (second, short)):
        assert answered(got[handle]) == answered(generate_many(model, [request], **settings)[0])


def test_pieces_accept_a_history_past_the_generation_configs_max_length():
    """take_prefix plans with one new token, as the run it prepares: a history longer than the model's
    generation_config.max_length (the server's tiny models: 512) is refused by neither (the request's own
    max_new_tokens decides). The first version planned with no options and refused it."""
    model = tiny_model("llama")
    model.generation_config.max_length = 30
    request = BatchRequest(prompt(40, seed=3)[0], max_new_tokens=3)
    whole = generate_many(model, [request], rows=ROWS, canonical_chunk=8)[0]
    pieces = generate_many(model, [request], rows=ROWS, canonical_chunk=8, prefill_tokens=8)[0]
    assert answered(pieces) == answered(whole) and len(whole.tokens) == 3


@pytest.mark.parametrize("arch", ["gemma3_text", "lfm2"])
def test_pieces_follow_turn_marks_and_a_diverging_state_as_one_run_does(arch):
    """Pieces end at the cuts the turn marks make (a history that ends inside an incomplete mark included),
    and a state whose history was edited rolls back to the same cut either way: answers and reuse equal."""
    model = model_in(arch, torch.bfloat16)
    mark = [7, 8]
    turns = [mark + prompt(n, seed=n)[0].tolist() for n in (12, 29, 5, 21)]
    marked = BatchRequest(torch.tensor([1, *[t for turn in turns for t in turn], mark[0]]), max_new_tokens=3,
                          top_logprobs=2)
    session = Session(model, canonical_chunk=8)
    session.generate(prompt(70, seed=1), max_new_tokens=4, do_sample=False)
    edited = BatchRequest(torch.cat([session.state.tokens[0, :37], prompt(50, seed=5)[0]]), max_new_tokens=3,
                          top_logprobs=2, state=session.state)
    for request, options in ((marked, {"canonical_chunk": 16, "canonical_marks": mark}),
                             (edited, {"canonical_chunk": 8})):
        whole = generate_many(model, [request], rows=ROWS, **options)[0]
        for budget in (1, 9):
            pieces = generate_many(model, [request], rows=ROWS, prefill_tokens=budget, **options)[0]
            assert answered(pieces) == answered(whole) and pieces.reused == whole.reused, (budget, options)
            assert torch.equal(pieces.prefilled.last_logits, whole.prefilled.last_logits)


def test_a_history_cancelled_between_its_pieces_leaves_nothing_behind():
    model = model_in("llama", torch.float32)
    scheduler = Scheduler(model, batch_settings(model, rows=ROWS, canonical_chunk=8, prefill_tokens=8))
    handle = scheduler.submit(BatchRequest(prompt(60, seed=9)[0], max_new_tokens=3))
    assert scheduler.step() == [] and scheduler.step() == [] and scheduler.busy  # two pieces fed, no token yet
    scheduler.cancel(handle)
    (done,) = scheduler.step()
    assert isinstance(done, Done) and done.completion.finish_reason == "cancelled" and done.completion.state is None
    assert not scheduler.busy
    after = BatchRequest(prompt(20, seed=10)[0], max_new_tokens=3)
    late = scheduler.submit(after)
    got = next(e.completion for e in scheduler.run() if isinstance(e, Done) and e.handle == late)
    assert answered(got) == answered(generate_many(model, [after], rows=ROWS, canonical_chunk=8)[0])


@pytest.mark.parametrize("budget", [8, 33])
def test_a_compressed_state_is_continued_in_one_run_not_in_pieces(budget):
    """A compressed state holds no canonical cut to feed pieces from: its feed is chunked from where it ends,
    so pieces would change the forwards. It is continued in one run, as without a prefill budget."""
    from kvstate.compress import KNorm

    model = model_in("llama", torch.bfloat16)
    session = Session(model, canonical_chunk=8)
    session.generate(prompt(40, seed=1), max_new_tokens=1, do_sample=False)
    session.compress(KNorm(0.5))
    ids = torch.cat([session.state.tokens[0], prompt(50, seed=2)[0]])
    request = BatchRequest(ids, max_new_tokens=5, top_logprobs=2, state=session.state)
    whole = generate_many(model, [request], rows=ROWS, canonical_chunk=8)[0]
    budgeted = generate_many(model, [request], rows=ROWS, canonical_chunk=8, prefill_tokens=budget)[0]
    assert answered(budgeted) == answered(whole) and budgeted.reused == whole.reused == 40
    assert torch.equal(budgeted.prefilled.last_logits, whole.prefilled.last_logits)


def test_pieces_start_from_the_longest_prefix_a_source_holds_and_count_only_it_as_reused():
    model = model_in("llama", torch.float32)
    first = BatchRequest(prompt(40, seed=5)[0], max_new_tokens=3)
    second = BatchRequest(torch.cat([prompt(40, seed=5)[0], prompt(30, seed=6)[0]]), max_new_tokens=3)
    scheduler = Scheduler(model, batch_settings(model, rows=ROWS, canonical_chunk=8, prefill_tokens=10))
    done = {}
    for request in (first, second):
        handle = scheduler.submit(request)
        done[handle] = next(e.completion for e in scheduler.run() if isinstance(e, Done))
    together, alone = done[1], generate_many(model, [second], rows=ROWS, canonical_chunk=8, share_prefixes=False)[0]
    assert together.reused == 40 and alone.reused == 0  # the first prompt's canonical chunks, then its own pieces
    assert answered(together) == answered(alone)
    assert_same_state(together.prefilled, alone.prefilled)
