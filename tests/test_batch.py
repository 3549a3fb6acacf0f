"""A request answered in a batch is bit for bit the request answered alone.

Hypothesis drives arrival steps, prompt lengths, greedy and seeded sampling, top log-probabilities,
batch limits and cancellations, on tiny llama, gemma3_text (sliding window), qwen3_vl (images) and
lfm2 (hybrid: conv layers, decoded one stream per forward) in float32 and bfloat16. "Alone" is the
same ``Scheduler`` with one request; token ids, log-probabilities and top log-probabilities must be
equal as floats. Independent oracles: greedy answers equal plain ``model.generate``'s tokens, and a
batch state continued by a ``Session`` equals a cold ``Session`` bitwise. The tiles the packed forward
runs in are ``test_batch_tiles.py``'s, long histories fed in pieces ``test_batch_pieces.py``'s and the
sampler ``test_batch_sampling.py``'s; ``ROWS``, ``answered`` and ``model_in`` are shared with them.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate import Session
from kvstate.batch import BatchRequest, Done, Failed, Sampling, Scheduler, Token, batch_settings, generate_many
from kvstate.engine.batched.decode import packable
from kvstate.errors import FingerprintMismatchError, InputError
from kvstate.selfcheck import bind
from kvstate.testing.shrink import tiny_causal_lm
from kvstate.testing.tiny import CONFIGS, IMAGE_TOKEN, RECURRENT, image_span, tiny_image
from tiny import prompt, tiny_model

# examples per case: the suite's share of its 5 minutes; KVSTATE_BATCH_EXAMPLES=50 is the recorded stress run
EXAMPLES = int(os.environ.get("KVSTATE_BATCH_EXAMPLES", "4"))
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
