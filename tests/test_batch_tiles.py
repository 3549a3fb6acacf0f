"""The tiles a packed forward runs in: a row's bits depend on neither its place nor the other rows.

Independent oracles: the plain packed forward (``invariant=False``) is shown to differ on a wide model
(as wide as the default model, where kernels change with the row count) where the invariant one does
not; one-row tiles are ``Session``'s own decode bitwise; grouped decode attention in bfloat16 tiles is
transformers' sdpa head for head. After the census a forward of one tile skips the tiling mode, and
fewer streams run fewer rows, with the bits of a whole tile; a rows probe refuses kernels whose bits
follow the row count; prepacked weights are made again when a weight changes, and weights that
cannot be prepacked are a typed error before any stream changed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from kvstate import Session
from kvstate.batch import BatchRequest, Done, Failed, Sampling, Scheduler, batch_settings, generate_many
from kvstate.engine.batched.invariant import rows_free, tile_kernels, tiled, tiled_linear
from kvstate.engine.batched.kernels import tile_kernel
from kvstate.errors import UnsupportedError
from kvstate.testing.shrink import tiny_causal_lm
from test_batch import ROWS, answered, model_in
from tiny import prompt, tiny_model


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
