"""The core resume contract, as one matrix: architectures x operations.

Every test compares against a fresh run on plain transformers: token ids exactly,
logits bitwise where kvstate runs the same computation, else within 1e-5 x scale.
"""

from __future__ import annotations

import pytest
import torch

from kvstate import Session
from tiny import SLIDING, WINDOW, assert_logits_close, prompt, tiny_model

ARCHS = ["llama", "qwen3", "qwen2", "mistral", "gemma2", "gemma3_text"]
N_NEW = 16


def greedy(model, ids, n=N_NEW, **kw):
    """Plain transformers reference: greedy tokens and first-step logits.

    The mask is explicit: without it generate treats any token equal to the pad id as padding.
    """
    kw.setdefault("attention_mask", torch.ones_like(ids))
    out = model.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, **kw)
    return out.sequences[:, ids.shape[1]:], out.logits[0]


def session_greedy(session, ids, n=N_NEW, **kw):
    out = session.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                           output_logits=True, **kw)
    return out.sequences, out.logits[0]


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


# 0: the longest-prefix planner (the opt-out); 8: the canonical schedule, whose resumes restart at the last
# multiple of 8 fed in aligned chunks, so reuse is checked against that rule, written apart here
@pytest.fixture(params=[0, 8], ids=["longest-prefix", "canonical"])
def chunk(request):
    return request.param


def kept(n, chunk):
    """Slots a resume keeps of ``n`` reusable ones that were prefilled in aligned chunks."""
    return n if chunk == 0 else n // chunk * chunk


@pytest.fixture
def model(arch):
    return tiny_model(arch)


def test_split_resume_equals_full_run(model, chunk):
    ids = prompt(3 * WINDOW)  # crosses the sliding window
    ref_tokens, ref_logits = greedy(model, ids)
    s = Session(model, canonical_chunk=chunk)
    s.extend(ids[:, :20])
    tokens, logits = session_greedy(s, ids)
    assert s.last_plan.mode == ("continue" if chunk == 0 else "realign")
    assert s.last_plan.fed == ids.shape[1] - kept(20, chunk)
    assert torch.equal(tokens, ref_tokens)
    assert_logits_close(logits, ref_logits, "first-step logits")
    # the state now holds the history and every generated token but the last
    assert s.state.tokens_seen == ids.shape[1] + N_NEW - 1


def test_fully_processed_history_uses_stored_logits(model):
    ids = prompt(25)
    ref_tokens, _ = greedy(model, ids)
    s = Session(model)
    s.extend(ids)
    seen_before = s.state.tokens_seen
    tokens = s.generate(ids, max_new_tokens=N_NEW, do_sample=False)
    assert s.last_plan is not None and s.last_plan.fed == 0  # nothing re-fed
    assert torch.equal(tokens, ref_tokens)
    assert s.state.tokens_seen == seen_before + N_NEW - 1


def test_reset_equals_fresh_instance(arch, model):
    a, b = prompt(30, seed=2), prompt(22, seed=3)
    s = Session(model)
    s.extend(a)
    s.generate(a, max_new_tokens=8, do_sample=False)
    s.reset()
    logits_b = s.extend(b[:, :-4])
    tokens_b, first_b = session_greedy(s, b)

    fresh = Session(tiny_model(arch))  # same seed, freshly constructed
    fresh_logits = fresh.extend(b[:, :-4])
    fresh_tokens, fresh_first = session_greedy(fresh, b)
    assert torch.equal(logits_b, fresh_logits)  # bitwise: same computation
    assert torch.equal(first_b, fresh_first)
    assert torch.equal(tokens_b, fresh_tokens)
    plain = model(b[:, :-4]).logits[:, -1]
    assert_logits_close(logits_b, plain, "after reset vs plain forward")


def test_fork_independence(model, chunk):
    prefix = prompt(20)
    a = torch.cat([prefix, prompt(6, seed=4)], 1)
    b = torch.cat([prefix, prompt(9, seed=5)], 1)
    s = Session(model, canonical_chunk=chunk)
    s.extend(prefix)
    f = s.fork()
    tokens_a = s.generate(a, max_new_tokens=N_NEW, do_sample=False)
    assert torch.equal(f.tokens, prefix)  # the fork did not see a's tokens
    tokens_b = f.generate(b, max_new_tokens=N_NEW, do_sample=False)
    assert torch.equal(tokens_a, greedy(model, a)[0])
    assert torch.equal(tokens_b, greedy(model, b)[0])
    assert f.last_plan.mode == ("continue" if chunk == 0 else "realign") and f.last_plan.reused == kept(20, chunk)


def test_chunked_prefill_equals_single(model):
    ids = prompt(40)
    single = Session(model).extend(ids)
    chunked = Session(model, chunk_size=7).extend(ids)
    assert_logits_close(chunked, single, "chunk_size=7")
    s = Session(model)
    for start in range(0, 40, 9):  # several extend calls
        logits = s.extend(ids[:, start:start + 9])
    assert_logits_close(logits, single, "several extends")
    assert_logits_close(single, model(ids).logits[:, -1], "vs plain forward")


def test_divergent_history_rolls_back(model, chunk):
    a = prompt(30)
    s = Session(model, canonical_chunk=chunk)
    s.generate(a, max_new_tokens=N_NEW, do_sample=False)
    b = torch.cat([a[:, :24], prompt(5, seed=7)], 1)  # diverges inside the processed part
    tokens = s.generate(b, max_new_tokens=N_NEW, do_sample=False)
    assert s.last_plan.mode == "rollback" and s.last_plan.reused == kept(24, chunk)
    assert torch.equal(tokens, greedy(model, b)[0])


@pytest.mark.parametrize("arch", SLIDING)
def test_sliding_truncate_within_reserve_is_exact(arch):
    model = tiny_model(arch)
    ids = prompt(3 * WINDOW)
    s = Session(model, sliding_reserve=6, canonical_chunk=0)  # the reserve alone (the schedule raises it to C - 1)
    s.extend(ids[:, :-2])
    s.extend(ids[:, -2:])  # the last append: 2 slots
    s.truncate(ids.shape[1] - 2 - 6)  # exactly the reserve past the start of the last append
    other = prompt(4, seed=9)
    logits = s.extend(other)
    reference = model(torch.cat([ids[:, :-8], other], 1)).logits[:, -1]
    assert_logits_close(logits, reference, "after truncate")
    sliding = [layer for layer in s.state.layers if layer.kind == "sliding_attention"]
    assert all(layer.slots == WINDOW - 1 + 4 for layer in sliding)  # reserve refills as tokens arrive
    assert all(layer.tokens_seen == ids.shape[1] - 4 for layer in s.state.layers)


@pytest.mark.parametrize("arch", SLIDING)
def test_sliding_rollback_beyond_reserve(arch):
    from kvstate.errors import RollbackError

    model = tiny_model(arch)
    ids = prompt(3 * WINDOW)
    s = Session(model, sliding_reserve=2, canonical_chunk=0)
    s.extend(ids[:, :-1])
    s.extend(ids[:, -1:])  # the last append: 1 slot, then the reserve of 2 past it
    with pytest.raises(RollbackError, match="sliding_reserve"):
        s.truncate(ids.shape[1] - 4)
    # generate() falls back to re-feeding, and is still exact
    b = torch.cat([ids[:, :-5], prompt(3, seed=8)], 1)
    tokens = s.generate(b, max_new_tokens=N_NEW, do_sample=False)
    assert s.last_plan.mode == "recompute"
    assert torch.equal(tokens, greedy(model, b)[0])


def test_full_attention_truncates_anywhere():
    model = tiny_model("llama")
    ids = prompt(30)
    s = Session(model)
    s.extend(ids)
    s.truncate(3)
    logits = s.extend(ids[:, 3:10])
    assert_logits_close(logits, model(ids[:, :10]).logits[:, -1])


def left_pad(rows: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.shape[-1] for r in rows)
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[-1]:] = r
        mask[i, width - r.shape[-1]:] = 1
    return ids, mask


def test_left_padded_batch_equals_rows_alone(model):
    long, short = prompt(28, seed=11)[0], prompt(19, seed=12)[0]
    ids, mask = left_pad([long, short])
    s = Session(model)
    s.extend(ids[:, :20], mask[:, :20])
    out = s.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False,
                     return_dict_in_generate=True, output_logits=True)
    for row, alone in enumerate([long, short]):
        ref_tokens, ref_logits = greedy(model, alone[None])
        assert torch.equal(out.sequences[row:row + 1], ref_tokens), f"row {row}"
        assert_logits_close(out.logits[0][row], ref_logits[0], f"row {row} first step")


def test_manual_loop_equals_generate_path(model):
    ids = prompt(26)
    s1 = Session(model)
    logits = s1.extend(ids)
    manual = []
    for _ in range(N_NEW):
        token = logits.argmax(-1, keepdim=True)
        manual.append(token)
        logits = s1.extend(token)
    s2 = Session(model)
    s2.extend(ids[:, :10])
    via_generate = s2.generate(ids, max_new_tokens=N_NEW, do_sample=False)
    assert torch.equal(torch.cat(manual, 1), via_generate)


def test_sampling_and_streaming_pass_through(model):
    ids = prompt(24)
    torch.manual_seed(123)
    ref = model.generate(ids, max_new_tokens=N_NEW, do_sample=True, top_k=20, temperature=0.8)
    s = Session(model)
    s.extend(ids)  # fully processed: the first token is drawn from stored logits

    class Collect:
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.reshape(-1))

        def end(self):
            self.ended = True

    streamer = Collect()
    torch.manual_seed(123)
    tokens = s.generate(ids, max_new_tokens=N_NEW, do_sample=True, top_k=20, temperature=0.8,
                        streamer=streamer)
    assert torch.equal(tokens, ref[:, ids.shape[1]:])
    streamed = torch.cat(streamer.chunks)
    assert torch.equal(streamed, ref[0]) and streamer.ended  # prompt once, then every token


def test_multi_turn_chat_reuses_everything(model, chunk):
    turn1 = prompt(20)
    s = Session(model, canonical_chunk=chunk)
    reply1 = s.generate(turn1, max_new_tokens=8, do_sample=False)
    turn2 = torch.cat([turn1, reply1, prompt(6, seed=21)], 1)
    # the reference's mask: every id is a token (without one, generate masks a reply's pad id 0)
    reply2 = s.generate(turn2, torch.ones_like(turn2), max_new_tokens=8, do_sample=False)
    # canonically: only the prompt's aligned chunks are kept; the decoded reply is fed again in chunks
    reused = turn1.shape[1] + 8 - 1 if chunk == 0 else kept(turn1.shape[1], chunk)
    assert s.last_plan.reused == reused and s.last_plan.fed == turn2.shape[1] - reused
    assert torch.equal(reply2, greedy(model, turn2, n=8)[0])


def test_stored_logits_path_honours_stopping_rules():
    model = tiny_model("llama")
    ids = prompt(20)
    ones = torch.ones_like(ids)
    eos = int(Session(model).extend(ids).argmax())  # make the first token an EOS
    cases = [dict(max_new_tokens=5, eos_token_id=eos),
             dict(max_new_tokens=6, min_new_tokens=3, eos_token_id=eos),
             dict(max_length=26)]
    for kw in cases:
        ref = model.generate(ids, attention_mask=ones, do_sample=False, **kw)
        s = Session(model)
        s.extend(ids)
        out = s.generate(ids, do_sample=False, **kw)
        assert s.last_plan.mode == "stored-logits"
        assert torch.equal(out, ref[:, ids.shape[1]:]), kw
