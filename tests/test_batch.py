"""Issue 25, acceptance 1: a request answered in a batch is bit for bit the request answered alone.

Hypothesis drives arrival steps, prompt lengths, greedy and seeded sampling, top log-probabilities,
batch limits and cancellations, on tiny llama, gemma3_text (sliding window), qwen3_vl (images) and
lfm2 (hybrid: conv layers, decoded one stream per forward) in float32 and bfloat16. "Alone" is the
same ``Scheduler`` with one request; token ids, log-probabilities and top log-probabilities must be
equal as floats. Independent oracles: the plain packed forward (``invariant=False``) is shown to
differ on a wide model, greedy answers equal plain ``model.generate``'s tokens, and a batch state
continued by a ``Session`` equals a cold ``Session`` bitwise.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate import Session
from kvstate.batch import BatchRequest, Done, Failed, Sampling, Scheduler, Token, batch_settings, generate_many
from kvstate.batch.sampling import first_max
from kvstate.engine.batched.decode import packable
from kvstate.engine.batched.invariant import rows_free, tile_kernels, tiled, tiled_linear
from kvstate.engine.batched.kernels import tile_kernel
from kvstate.errors import FingerprintMismatchError, InputError, UnsupportedError
from kvstate.selfcheck import bind
from kvstate.testing.shrink import tiny_causal_lm
from kvstate.testing.tiny import CONFIGS, IMAGE_TOKEN, RECURRENT, image_span, tiny_image
from tiny import assert_same_state, prompt, tiny_model

# examples per case: the suite's share of its 5 minutes; KVSTATE_BATCH_EXAMPLES=50 is the recorded stress run
EXAMPLES = int(os.environ.get("KVSTATE_BATCH_EXAMPLES", "10"))
ROWS = 4  # the packed forward's tile: small, so batches of 1-16 cross several tiles (and keep a spare row)


@functools.cache
def model_in(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    return tiny_model(arch).to(dtype)


def history(arch: str, length: int, seed: int, image: bool, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """``[L]`` ids; for qwen3_vl with ``image``, an image inside the prompt and its inputs."""
    if arch != "qwen3_vl" or not image:
        return prompt(length, seed=seed)[0], {}
    pixels, grid, n = tiny_image((4, 4), seed=seed)
    ids = torch.cat([prompt(max(length // 2, 1), seed=seed), image_span(n), prompt(3, seed=seed + 1)], 1)[0]
    return ids, {"pixel_values": pixels.to(dtype), "image_grid_thw": grid}


SAMPLING = st.one_of(st.just(Sampling()),
                     st.builds(Sampling, temperature=st.sampled_from([0.5, 1.0, 1.5]), top_k=st.sampled_from([0, 5]),
                               top_p=st.sampled_from([1.0, 0.9]), seed=st.integers(0, 2**16)))
REQUEST = st.fixed_dictionaries({
    "length": st.integers(1, 90), "seed": st.integers(0, 1000), "image": st.booleans(), "new": st.integers(1, 8),
    "sampling": SAMPLING, "top": st.integers(0, 3), "arrival": st.integers(0, 3),
    "cancel": st.one_of(st.none(), st.none(), st.integers(0, 6))})


def request_of(arch: str, dtype: torch.dtype, spec: dict) -> BatchRequest:
    ids, inputs = history(arch, spec["length"], spec["seed"], spec["image"], dtype)
    return BatchRequest(ids, max_new_tokens=spec["new"], sampling=spec["sampling"], top_logprobs=spec["top"],
                        inputs=inputs)


def answered(completion) -> tuple:
    return completion.tokens, completion.logprobs, completion.top_logprobs


def run_batched(model, requests, specs, max_batch: int, rows: int, prefill_tokens: int | None = None,
                canonical_chunk: int | None = None) -> dict[int, object]:
    """Submit each request at its arrival step, cancel at its cancel step; completions by request index.
    With ``prefill_tokens``, histories longer than that are fed in pieces over several steps."""
    scheduler = Scheduler(model, batch_settings(model, max_batch=max_batch, rows=rows, prefill_tokens=prefill_tokens,
                                                canonical_chunk=canonical_chunk))
    handles: dict[int, int] = {}
    done: dict[int, object] = {}
    step = 0
    while step <= 4 or scheduler.busy:
        for i, spec in enumerate(specs):
            if spec["arrival"] == step:
                handles[scheduler.submit(requests[i])] = i
            if spec["cancel"] == step and i in handles.values():
                scheduler.cancel(next(h for h, j in handles.items() if j == i))
        for event in scheduler.step():
            if isinstance(event, Done):
                done[handles[event.handle]] = event.completion
        step += 1
    return done


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(specs=st.integers(1, 16).flatmap(lambda n: st.lists(REQUEST, min_size=n, max_size=n)),
       max_batch=st.one_of(st.just(16), st.integers(1, 16)), rows=st.sampled_from([4, 16]),
       prefill_tokens=st.one_of(st.none(), st.integers(1, 80)), chunk=st.sampled_from([None, 8, 24]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_vl", "lfm2"])
def test_a_batched_answer_is_the_answer_alone_bitwise(arch, dtype, specs, max_batch, rows, prefill_tokens, chunk):
    model = model_in(arch, dtype)
    requests = [request_of(arch, dtype, spec) for spec in specs]
    batched = run_batched(model, requests, specs, max_batch, rows, prefill_tokens, chunk)
    assert sorted(batched) == list(range(len(specs)))  # every request finished, cancelled or not
    for i, request in enumerate(requests):
        got = batched[i]
        alone = generate_many(model, [request], rows=rows, canonical_chunk=chunk)[0]  # one whole prefill
        if got.finish_reason == "cancelled":  # what it streamed before the cancel is the start of its answer
            assert answered(got) == tuple(x[:len(got.tokens)] for x in answered(alone)), f"request {i}"
            continue
        assert answered(got) == answered(alone), f"request {i} of {len(specs)}, max_batch {max_batch}"
        assert got.finish_reason == alone.finish_reason == "length"


@pytest.mark.parametrize("rows", [4, 16])  # 4: a spare padding row at the end (tiny widths); 16: none
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_vl", "lfm2"])
def test_sixteen_at_once_are_each_the_answer_alone(arch, dtype, rows):
    model = model_in(arch, dtype)
    specs = [{"length": 5 + 7 * i, "seed": i, "image": i % 3 == 0, "new": 3 + i % 4, "top": i % 3,
              "sampling": Sampling(temperature=1.0, top_k=5 * (i % 2), seed=i) if i % 2 else Sampling()}
             for i in range(16)]
    requests = [request_of(arch, dtype, spec) for spec in specs]
    scheduler = Scheduler(model, batch_settings(model, max_batch=16, rows=rows))
    handles = [scheduler.submit(r) for r in requests]
    scheduler.step()
    assert scheduler.running == 16  # they share forwards
    done = {e.handle: e.completion for e in [*scheduler.run()] if isinstance(e, Done)}
    for handle, request in zip(handles, requests, strict=True):
        assert answered(done[handle]) == answered(generate_many(model, [request], rows=rows)[0]), handle


@pytest.mark.parametrize("arch", sorted(set(CONFIGS) - {"qwen3_vl"}))
def test_every_family_decodes_batched_as_alone(arch):
    model = tiny_model(arch)
    requests = [BatchRequest(prompt(3 + 8 * i, seed=i)[0], max_new_tokens=3,
                             sampling=Sampling(temperature=1.0, seed=i) if i % 2 else Sampling()) for i in range(4)]
    scheduler = Scheduler(model, batch_settings(model, rows=ROWS))
    handles = [scheduler.submit(r) for r in requests]
    done = {e.handle: e.completion for e in scheduler.run() if isinstance(e, Done)}
    # attention-only families share the forward; recurrent and hybrid ones decode one stream per forward
    assert packable(scheduler.engine, done[handles[0]].prefilled) == (arch not in RECURRENT) and scheduler.packing
    for handle, request in zip(handles, requests, strict=True):
        assert answered(done[handle]) == answered(generate_many(model, [request], rows=ROWS)[0]), handle


STRUCTURAL = {  # arch: (whether decode steps share forwards, whether the scheduler still packs afterwards)
    "gpt2": (True, True),
    "falcon": (False, False),  # asks the cache for one sequence length: falls back at its first packed step
    "xglm": (False, False),  # the same
    # MLA: transformers 5.24 attends with K/V expanded from the cached latents (falls back at its first packed
    # step); 5.14 attends with what its cache returns (packs). Either way, consistently, and alone-equal
    "deepseek_v3": (None, None),
    "bloom": (False, True),  # ALiBi, no position ids: never tries
    "gpt_oss": (True, True),  # MoE through grouped_mm: tiled per expert
    "qwen3_moe": (True, True),
}


@pytest.mark.parametrize("arch", STRUCTURAL)
def test_structural_families_pack_or_fall_back_and_stay_alone_equal(arch):
    shared, packing = STRUCTURAL[arch]
    model = tiny_causal_lm(arch).eval()
    model.generation_config.eos_token_id = None
    requests = [BatchRequest(prompt(4 + 9 * i, seed=i)[0], max_new_tokens=4) for i in range(4)]
    scheduler = Scheduler(model, batch_settings(model, rows=ROWS))
    handles = [scheduler.submit(r) for r in requests]
    done = {e.handle: e.completion for e in scheduler.run() if isinstance(e, Done)}
    shares = scheduler.packing and packable(scheduler.engine, done[handles[0]].prefilled)
    assert shares == (scheduler.packing if shared is None else shared)
    assert scheduler.packing == (shares if packing is None else packing)
    for handle, request in zip(handles, requests, strict=True):
        assert answered(done[handle]) == answered(generate_many(model, [request], rows=ROWS)[0]), handle
        plain = model.generate(torch.as_tensor(request.ids)[None], max_new_tokens=4, do_sample=False)
        assert list(done[handle].tokens) == plain[0, len(request.ids):].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_shared_system_prompt_is_computed_once_and_answers_stay_cold(dtype):
    model = model_in("gemma3_text", dtype)
    system = prompt(150, seed=11)[0]
    requests = [BatchRequest(torch.cat([system, prompt(5 + i, seed=20 + i)[0]]), max_new_tokens=4, top_logprobs=2)
                for i in range(4)]
    together = generate_many(model, requests, rows=ROWS)
    assert [c.reused for c in together] == [0, 128, 128, 128]  # the system prompt's whole canonical chunks
    for request, completion in zip(requests, together, strict=True):
        alone = generate_many(model, [request], rows=ROWS)[0]
        assert answered(completion) == answered(alone) and alone.reused == 0
    unshared = generate_many(model, requests, rows=ROWS, share_prefixes=False)
    assert [c.reused for c in unshared] == [0, 0, 0, 0] and list(map(answered, unshared)) == list(map(answered,
                                                                                                      together))


@pytest.mark.parametrize("pieces", [None, 16], ids=["whole", "in-pieces"])
@pytest.mark.parametrize("arch", ["gemma3_text", "lfm2"])
def test_a_second_turn_from_a_batch_state_is_the_cold_second_turn(arch, pieces):
    model = model_in(arch, torch.bfloat16)
    first = generate_many(model, [BatchRequest(prompt(80, seed=3)[0], max_new_tokens=5)], rows=ROWS,
                          prefill_tokens=pieces)[0]
    turn = torch.cat([prompt(80, seed=3)[0], torch.tensor(first.tokens), prompt(9 + 30 * bool(pieces), seed=4)[0]])
    warm = generate_many(model, [BatchRequest(turn, max_new_tokens=5, top_logprobs=3, state=first.state)],
                         rows=ROWS, prefill_tokens=pieces)[0]
    cold = generate_many(model, [BatchRequest(turn, max_new_tokens=5, top_logprobs=3)], rows=ROWS)[0]
    assert answered(warm) == answered(cold) and warm.reused == 64 and cold.reused == 0


def wide_llama(dtype: torch.dtype, vocab: int = 1000) -> torch.nn.Module:
    """A llama as wide as the default model (640 hidden, 2048 MLP), where kernels change with the row count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=640, intermediate_size=2048,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    return model


def test_the_plain_packed_forward_differs_where_the_invariant_one_does_not():
    model = wide_llama(torch.float32)
    gen = torch.Generator().manual_seed(0)
    requests = [BatchRequest(torch.randint(3, 1000, (7 + 11 * i,), generator=gen), max_new_tokens=4)
                for i in range(6)]
    for invariant, expect_equal in ((True, True), (False, False)):
        alone = [answered(generate_many(model, [r], invariant=invariant)[0]) for r in requests]
        batched = [answered(c) for c in generate_many(model, requests, invariant=invariant)]
        assert (alone == batched) is expect_equal, f"invariant={invariant}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_tile_forwards_skip_the_tiling_mode_after_the_census_with_the_same_bits(dtype, monkeypatch):
    # the mode costs a Python call per operation; a forward of one tile is the same calls without it, once the first
    # forward showed that every product spans all rows. Pinned to the mode, every step gives the same bits.
    from kvstate.engine.batched import decode

    model = wide_llama(dtype)
    gen = torch.Generator().manual_seed(1)
    requests = [BatchRequest(torch.randint(3, 1000, (5 + 13 * i,), generator=gen), max_new_tokens=6, top_logprobs=2,
                             sampling=Sampling(temperature=1.0, seed=i) if i % 2 else Sampling()) for i in range(5)]
    scheduler = Scheduler(model, batch_settings(model, rows=8))
    handles = [scheduler.submit(r) for r in requests]
    fast = {e.handle: answered(e.completion) for e in scheduler.run() if isinstance(e, Done)}
    assert scheduler._packed.plain  # the census passed: steps after the first ran without the mode
    entered = []
    monkeypatch.setattr(decode, "tiled_linear", lambda *a: entered.append(a) or tiled_linear(*a))
    monkeypatch.setattr(decode.Packed, "plain", property(lambda self: False, lambda self, value: None), raising=False)
    pinned = generate_many(model, requests, rows=8)
    assert len(entered) == 5  # one forward per decode step (the first token is the prefill's), each under the mode
    assert [fast[h] for h in handles] == [answered(c) for c in pinned]
    for arch in ("gpt_oss", "qwen3_moe"):  # expert routing: products span fewer rows in other forwards
        moe = tiny_causal_lm(arch).eval()
        scheduler = Scheduler(moe, batch_settings(moe, rows=ROWS))
        scheduler.submit(BatchRequest(prompt(6)[0], max_new_tokens=3))
        list(scheduler.run())
        assert not scheduler._packed.plain, arch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fewer_streams_run_fewer_rows_with_the_bits_of_a_whole_tile(dtype, monkeypatch):
    # prepacked kernels give a row the same bits for any 2..rows rows (probed), and widths that are multiples of
    # 64 leave element-wise kernels no tail: a step of n < rows streams then runs max(n, 2) rows, not a whole tile
    from kvstate.engine.batched import decode

    model = wide_llama(dtype, vocab=1024)  # every width a multiple of 128: no tail at any row count
    gen = torch.Generator().manual_seed(2)
    requests = [BatchRequest(torch.randint(3, 1024, (4 + 9 * i,), generator=gen), max_new_tokens=2 + i,
                             top_logprobs=2) for i in range(5)]  # 5, 4, 3, 2, 1 streams as they finish
    used = []
    rows_of = decode.Packed._rows
    monkeypatch.setattr(decode.Packed, "_rows", lambda self, n: used.append(rows_of(self, n)) or used[-1])
    scheduler = Scheduler(model, batch_settings(model, rows=16))
    handles = [scheduler.submit(r) for r in requests]
    free = {e.handle: answered(e.completion) for e in scheduler.run() if isinstance(e, Done)}
    assert scheduler._packed.free and scheduler._packed.grain == 1
    assert used == [16, 4, 3, 2, 2], used  # the first forward takes the census in a whole tile
    alone = [answered(generate_many(model, [r], rows=16)[0]) for r in requests]  # 2 rows a step
    monkeypatch.setattr(decode.Packed, "free", property(lambda self: False, lambda self, value: None), raising=False)
    used.clear()
    tiles = [answered(c) for c in generate_many(model, requests, rows=16)]
    assert set(used) == {16}
    assert [free[h] for h in handles] == tiles == alone


def test_the_rows_probe_refuses_kernels_whose_bits_follow_the_row_count():
    import torch.nn.functional as F

    linear = torch.nn.Linear(640, 1024, bias=False)  # float32 F.linear: another kernel for another row count
    assert not rows_free({linear: lambda x, bias: F.linear(x, linear.weight, bias)}, 16, range(2, 16))
    assert rows_free(tile_kernels([linear], 16, "-"), 16, [*range(2, 16), 17, 48, 100])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["wide llama", "llama", "gemma3_text"])
def test_one_row_tiles_are_session_decode_bitwise(arch, dtype):
    # with tiles of one row every product has Session's one-row decode shape: the packing itself (caches appended in
    # place, per-stream attention, positions) then changes no bit, and four conversations decode together as a Session
    # decodes each; a Session with the scheduler's prefill tile prefills each as the scheduler's packed prefill does.
    # The tiny models have 2 K/V heads: their layers attend over strided views of the room.
    model = wide_llama(dtype) if arch == "wide llama" else model_in(arch, dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    requests = [BatchRequest(torch.randint(3, vocab, (7 + 30 * i,), generator=gen), max_new_tokens=5)
                for i in range(4)]
    for request, completion in zip(requests, generate_many(model, requests, rows=1), strict=True):
        out = Session(model, prefill_rows=32).generate(torch.as_tensor(request.ids)[None], max_new_tokens=5,
                                                       do_sample=False, return_dict_in_generate=True,
                                                       output_logits=True)
        tokens = out.sequences[0].tolist()
        logprobs = [float(torch.log_softmax(step[0].float(), -1)[t])
                    for step, t in zip(out.logits, tokens, strict=True)]
        assert (tokens, logprobs) == (list(completion.tokens), list(completion.logprobs))


def test_decode_rows_attend_grouped_in_bf16_tiles_which_is_transformers_sdpa_head_for_head(monkeypatch):
    # the grouped form (kvstate.engine.batched.packed) is bf16's per-stream decode attention for tiles of more than
    # one row (where the pooled call does not apply: tests/test_batch_pool.py): 4-12x faster SDPA on this CPU than
    # enable_gqa. Its head mapping is transformers' (float64: equal to rounding), and one-row tiles keep the model's
    # own call (Session's decode, bitwise: the test above).
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import kvstate.engine.batched.packed as packed_module

    module = model_in("llama", torch.float32).model.layers[0].self_attn  # 4 query heads, 2 K/V heads
    gen = torch.Generator().manual_seed(3)
    room = torch.randn(2, 1, 2, 40, 8, generator=gen, dtype=torch.float64)
    key, value = room[0, :, :, :29], room[1, :, :, :29]  # strided views, as a pooled stream's slots
    query = torch.randn(1, 4, 1, 8, generator=gen, dtype=torch.float64)
    grouped, _ = packed_module._grouped(module, query[:, :, 0], key, value, None, scaling=0.3)  # heads [1, H, D]
    own, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.3)
    assert grouped.shape == own.shape == (1, 1, 4, 8)
    torch.testing.assert_close(grouped, own, rtol=1e-13, atol=1e-13)
    calls, real = [], packed_module._grouped
    monkeypatch.setattr(packed_module, "_grouped", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(packed_module, "_pool_free", lambda *a: False)  # the per-stream form
    for dtype, rows, used in [(torch.bfloat16, ROWS, True), (torch.bfloat16, 1, False), (torch.float32, ROWS, False)]:
        calls.clear()
        generate_many(model_in("llama", dtype), [BatchRequest(prompt(9)[0], max_new_tokens=3)], rows=rows)
        assert bool(calls) is used, (dtype, rows)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_vl", "lfm2"])
def test_greedy_answers_are_model_generates_tokens(arch):
    model = model_in(arch, torch.float32)
    requests = [BatchRequest(*history(arch, n, seed=n, image=True, dtype=torch.float32)[:1], max_new_tokens=5,
                             inputs=history(arch, n, seed=n, image=True, dtype=torch.float32)[1])
                for n in (3, 20, 70)]
    for request, completion in zip(requests, generate_many(model, requests, rows=ROWS), strict=True):
        ids = torch.as_tensor(request.ids)[None]
        types = {"mm_token_type_ids": (ids == IMAGE_TOKEN).int()} if request.inputs else {}  # as the processor
        plain = model.generate(ids, max_new_tokens=5, do_sample=False, **request.inputs, **types)
        assert list(completion.tokens) == plain[0, len(request.ids):].tolist()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_vl", "lfm2"])
def test_a_batch_state_continues_in_a_session_bitwise_as_a_cold_run(arch):
    model = model_in(arch, torch.bfloat16)
    if bind(model).caps.stepwise:
        pytest.skip(f"{arch} continues one token per forward here: no canonical schedule (docs/exactness.md)")
    made = [history(arch, n, seed=n, image=True, dtype=torch.bfloat16) for n in (140, 100, 5)]
    requests = [BatchRequest(ids, max_new_tokens=6, inputs=inputs) for ids, inputs in made]
    for request, completion in zip(requests, generate_many(model, requests, rows=ROWS), strict=True):
        turn = torch.cat([torch.as_tensor(request.ids), torch.tensor(completion.tokens), prompt(4, seed=9)[0]])[None]
        options = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True,
                       **request.inputs)
        # a Session with the scheduler's prefill tile continues the batch state as its own cold run
        warm = Session(model, state=completion.state, prefill_rows=32)
        a, b = warm.generate(turn, **options), Session(model, prefill_rows=32).generate(turn, **options)
        assert torch.equal(a.sequences, b.sequences) and torch.equal(torch.cat(a.logits), torch.cat(b.logits))
        assert warm.last_plan.reused == 64 * (len(request.ids) // 64), len(request.ids)  # the canonical prompt
        # a plain Session feeds slots of other kernels again, never reuses them; a hybrid (lfm2: conv layers)
        # has no tiled prefill, so its states are the plain Session's
        tiled = completion.state.canonical_device == "cpu+tile32"
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            plain = Session(model, state=completion.state, prefill_rows=0)
        assert any("fed again" in str(w.message) for w in told) == tiled  # it says why nothing is reused
        a, b = plain.generate(turn, **options), Session(model).generate(turn, **options)
        assert torch.equal(a.sequences, b.sequences) and torch.equal(torch.cat(a.logits), torch.cat(b.logits))
        assert plain.last_plan.reused == (0 if tiled else warm.last_plan.reused) and tiled == (arch != "lfm2")


def test_streamed_tokens_are_the_completion_and_a_waiting_request_can_be_cancelled():
    model = model_in("llama", torch.float32)
    scheduler = Scheduler(model, batch_settings(model, max_batch=1, rows=ROWS))
    first = scheduler.submit(BatchRequest(prompt(5)[0], max_new_tokens=3, top_logprobs=2))
    second = scheduler.submit(BatchRequest(prompt(6)[0], max_new_tokens=3))
    scheduler.cancel(second)
    events = list(scheduler.run())
    streamed = [e.choice for e in events if isinstance(e, Token) and e.handle == first]
    done = {e.handle: e.completion for e in events if isinstance(e, Done)}
    assert tuple(c.token for c in streamed) == done[first].tokens and len(done[first].tokens) == 3
    assert all(len(c.top) == 2 and c.top[0][1] >= c.logprob for c in streamed)
    assert done[second].finish_reason == "cancelled" and done[second].tokens == ()
    assert not any(isinstance(e, Token) and e.handle == second for e in events)


def test_a_refused_request_fails_alone_and_the_others_go_on():
    model = model_in("llama", torch.float32)
    scheduler = Scheduler(model, batch_settings(model, rows=ROWS))
    bad = scheduler.submit(BatchRequest([3, 100_000], max_new_tokens=2))
    good = scheduler.submit(BatchRequest(prompt(5)[0], max_new_tokens=2))
    events = list(scheduler.run())
    failed = [e for e in events if isinstance(e, Failed)]
    assert [e.handle for e in failed] == [bad] and isinstance(failed[0].error, InputError)
    done = {e.handle: e.completion for e in events if isinstance(e, Done)}
    assert list(done) == [good]
    assert answered(done[good]) == answered(generate_many(model, [BatchRequest(prompt(5)[0], max_new_tokens=2)],
                                                          rows=ROWS)[0])
    with pytest.raises(InputError):
        generate_many(model, [BatchRequest([3, 100_000])])


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


def test_a_step_checks_the_weights_once_between_events_and_again_after_a_caller_edits_them(monkeypatch):
    # each admitted prompt's session verbs check the weights (three walks of the model's tensors a prompt); between
    # two events of a step nothing can edit them, so one walk serves the stretch. An edit made while the caller
    # holds an event is seen by the next stretch: the prompts not yet started fail with the typed error.
    import kvstate.adapters.fingerprinting as fingerprinting

    model = copy.deepcopy(model_in("llama", torch.float32))  # its weights are edited below
    scheduler = Scheduler(model, batch_settings(model, rows=ROWS))
    for seed in range(4):
        scheduler.submit(BatchRequest(prompt(9 + seed, seed=seed)[0], max_new_tokens=2))
    walks, real = [], fingerprinting.weights_key
    monkeypatch.setattr(fingerprinting, "weights_key", lambda m: walks.append(1) or real(m))
    events = scheduler.stepping()
    assert isinstance(next(events), Token) and len(walks) == 1  # four prompts admitted and fed, one started
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    rest = list(events)
    failed = [e for e in rest if isinstance(e, Failed)]
    assert len(failed) == 3 and all(isinstance(e.error, FingerprintMismatchError) for e in failed)


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


@pytest.mark.parametrize("kernel", ["F.linear", "prepacked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [4, 8, 16])
def test_a_tiled_row_depends_on_neither_its_place_nor_the_other_rows(dtype, rows, kernel):
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(2048, 640, generator=gen).to(dtype), torch.randn(3 * rows, 640, generator=gen).to(dtype)
    bias = torch.randn(2048, generator=gen).to(dtype)
    packed = tile_kernel(weight, rows) if kernel == "prepacked" else None
    if kernel == "prepacked" and packed is None:
        pytest.skip("this torch has no oneDNN linear kernels")
    for b in (None, bias):
        reference = tiled(x[:1], weight, b, rows, packed)[0]
        for place in (0, rows - 1, rows + 2, 3 * rows - 1):
            others = torch.randn(3 * rows, 640, generator=gen).to(dtype)
            others[place] = x[0]
            assert torch.equal(tiled(others, weight, b, rows, packed)[place], reference), place
        padded = F.pad(x[:1], (0, 0, 0, rows - 1))
        assert torch.equal(reference, (packed(padded, b) if packed else F.linear(padded, weight, b))[0])


def test_weights_that_cannot_be_prepacked_give_a_typed_error_before_any_stream_changed(monkeypatch):
    from kvstate.engine.batched import kernels

    if not kernels.available():
        pytest.skip("this torch has no oneDNN linear kernels")

    def refuse(weight, rows):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    model = tiny_model("llama")  # fresh weights: nothing prepacked yet
    requests = [BatchRequest(prompt(6 + i, seed=i)[0], max_new_tokens=3, top_logprobs=2) for i in range(2)]
    # the prefill's tiles: each request fails on its own, with the fix, and nothing ran for it
    scheduler = Scheduler(model, batch_settings(model, rows=ROWS))
    handles = [scheduler.submit(r) for r in requests]
    monkeypatch.setattr(kernels, "_reorder", refuse)
    events = list(scheduler.run())
    assert [e.handle for e in events] == handles and all(isinstance(e, Failed) for e in events)
    assert all(isinstance(e.error, UnsupportedError) and "--batch-prefill-rows 0" in str(e.error)
               and "not enough memory" in str(e.error) for e in events)
    # the decode's tiles (prompts prefilled without tiles): the step raises before any stream changed
    scheduler = Scheduler(model, batch_settings(model, rows=ROWS, prefill_rows=0))
    handles = [scheduler.submit(r) for r in requests]
    with pytest.raises(UnsupportedError) as info:
        list(scheduler.run())
    assert "--batch-prepack off" in str(info.value) and "not enough memory" in str(info.value)
    assert all(not j.stream.fed and j.stream.live is None for j in scheduler._running)  # the forward never ran
    monkeypatch.undo()  # memory again: the same scheduler goes on, each answer as a fresh scheduler gives it
    done = {e.handle: answered(e.completion) for e in scheduler.run() if isinstance(e, Done)}
    fresh = generate_many(model, requests, rows=ROWS, prefill_rows=0)
    assert [done[h] for h in handles] == [answered(c) for c in fresh]


def test_the_packed_decode_runs_its_tiles_on_prepacked_weights_made_again_when_a_weight_changes():
    from kvstate.engine.batched import kernels

    if not kernels.available():
        pytest.skip("this torch has no oneDNN linear kernels")
    model = wide_llama(torch.float32)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    requests = [BatchRequest(prompt(5 + 9 * i, seed=i)[0], max_new_tokens=4, top_logprobs=2) for i in range(3)]
    before = [answered(c) for c in generate_many(model, requests, rows=8)]
    assert all(8 in kernels._held(m.weight) for m in linears)  # every product of the tile ran prepacked
    assert before != [answered(c) for c in generate_many(model, requests, rows=8, prepack=False)]  # other kernels
    with torch.no_grad():  # in place: the packed copies are stale, and must not be used
        for m in linears:
            m.weight.mul_(1.25)
    fresh = copy.deepcopy(model)  # new weight tensors, packed from scratch
    changed = [answered(c) for c in generate_many(model, requests, rows=8)]
    assert changed == [answered(c) for c in generate_many(fresh, requests, rows=8)] and changed != before
    # one-row tiles keep Session's decode kernels
    assert Scheduler(model, batch_settings(model, rows=1))._packed.linears == []


ERRORS = {
    "max_new_tokens=0": (lambda m: BatchRequest([3, 4], max_new_tokens=0), InputError),
    "max_new_tokens=2.0": (lambda m: BatchRequest([3, 4], max_new_tokens=2.0), InputError),
    "top_logprobs=21": (lambda m: BatchRequest([3, 4], top_logprobs=21), InputError),
    "temperature=-1": (lambda m: Sampling(temperature=-1.0), InputError),
    "temperature=nan": (lambda m: Sampling(temperature=float("nan")), InputError),
    "top_p=0": (lambda m: Sampling(top_p=0.0), InputError),
    "top_k=-2": (lambda m: Sampling(top_k=-2), InputError),
    "max_batch=0": (lambda m: Scheduler(m, batch_settings(m, max_batch=0)), InputError),
    "prefill_tokens=0": (lambda m: Scheduler(m, batch_settings(m, prefill_tokens=0)), InputError),
    "rows=True": (lambda m: Scheduler(m, batch_settings(m, rows=True)), InputError),
    "submit a list": (lambda m: Scheduler(m).submit([3, 4]), InputError),
}


@pytest.mark.parametrize("case", ERRORS)
def test_misuse_raises_a_typed_error(case):
    call, error = ERRORS[case]
    with pytest.raises(error) as info:
        call(model_in("llama", torch.float32))
    assert "expected" in str(info.value) and "fix" in str(info.value)


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

