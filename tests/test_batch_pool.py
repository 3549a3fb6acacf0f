"""The decode pool (``kvstate.engine.batched.pool``): one K/V buffer a layer for every stream of packed
decode steps, one append and (where the padding probe holds) one attention call a layer and step.

Oracles: each request alone through the same scheduler (bitwise), a cold ``Session`` (greedy tokens), transformers'
own sdpa function per stream (float64, to rounding), and the per-stream form over the same slots."""

from __future__ import annotations

import functools

import pytest
import torch

import kvstate._compat.attention as kernel_rule
import kvstate.engine.batched.pool as pool_module
from kvstate import Session
from kvstate.batch import BatchRequest, Done, Sampling, Scheduler, batch_settings, generate_many
from kvstate.engine.batched.pool import BUCKET, Pool, attention_free
from tiny import prompt, tiny_model

ROWS = 4


@functools.cache
def model_in(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    return tiny_model(arch).to(dtype)


def requests(n: int, new: int = 5) -> list[BatchRequest]:
    return [BatchRequest(prompt(3 + 11 * i, seed=i)[0], max_new_tokens=new + i % 3, top_logprobs=i % 3,
                         sampling=Sampling(temperature=1.0, top_k=5, seed=i) if i % 2 else Sampling())
            for i in range(n)]


def answers(model: torch.nn.Module, batch: list[BatchRequest], **options) -> list[tuple]:
    return [(c.tokens, c.logprobs, c.top_logprobs) for c in generate_many(model, batch, rows=ROWS, **options)]


def alone(model: torch.nn.Module, batch: list[BatchRequest]) -> list[tuple]:
    return [answers(model, [request])[0] for request in batch]


def test_a_packed_step_appends_in_place_and_the_finished_state_owns_its_slots():
    # a concatenating cache copies every layer's K/V at every step (O(history) per token and stream)
    model = model_in("gemma3_text", torch.float32)  # sliding and full layers
    scheduler = Scheduler(model, batch_settings(model, rows=ROWS))
    request = BatchRequest(prompt(40)[0], max_new_tokens=6, stop_ids=())
    handle = scheduler.submit(request)
    scheduler.step()
    stream = scheduler._running[0].stream
    pool = stream.pool
    pointers = []
    for _ in range(3):
        scheduler.step()
        pointers.append([buffer.data_ptr() for buffer in pool.keys + pool.values])
        assert pool.lengths[stream.slot] == [40 + len(stream.fed)] * len(pool.keys)
    assert pointers[0] == pointers[1] == pointers[2]  # the same buffers, written in place
    done = {e.handle: e.completion for e in scheduler.run() if isinstance(e, Done)}[handle]
    assert not pool.lengths and not pool.keys  # the slot freed, and the buffers with the last stream
    for layer in done.state.layers:  # copied out of the pool: contiguous, nothing spare kept alive
        assert layer.keys.is_contiguous() and layer.keys.untyped_storage().nbytes() == layer.keys.nbytes
        assert layer.keys.shape[-2] == 40 + 5
    cold = Session(model).generate(prompt(40), max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert list(done.tokens) == cold[0].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_the_pooled_call_is_the_decode_attention_of_tiles_where_the_padding_probe_holds(monkeypatch, arch, dtype):
    calls, real = [], pool_module.Step.attend
    monkeypatch.setattr(pool_module.Step, "attend", lambda *a: calls.append(1) or real(*a))
    model = model_in(arch, dtype)
    attention = model.model.layers[0].self_attn
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    free = attention_free(dtype, kv_heads, heads // kv_heads, attention.head_dim, torch.device("cpu"))
    batch = requests(6)
    assert answers(model, batch) == alone(model, batch)
    assert bool(calls) is free
    calls.clear()
    generate_many(model, batch[:2], rows=1)  # one-row tiles keep Session's decode
    assert not calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_where_the_probe_refuses_each_row_attends_alone_over_its_slots_with_the_same_answers(monkeypatch, dtype):
    model = model_in("gemma3_text", dtype)
    batch = requests(6)
    pooled = answers(model, batch)
    monkeypatch.setattr(pool_module, "_FREE", {})
    monkeypatch.setattr(pool_module, "_probe", lambda *a: False)
    calls, real = [], pool_module.Step.attend
    monkeypatch.setattr(pool_module.Step, "attend", lambda *a: calls.append(1) or real(*a))
    one_by_one = answers(model, batch)
    assert one_by_one == alone(model, batch) and not calls
    tokens = [a[0] for a in one_by_one]
    if dtype == torch.float32:  # other attention kernels: greedy tokens agree on this tiny model, bits need not
        assert tokens == [a[0] for a in pooled]


def test_the_probe_refuses_an_attention_kernel_whose_bits_follow_the_padding(monkeypatch):
    real = torch.nn.functional.scaled_dot_product_attention

    def padded_sum(q, k, v, attn_mask=None, scale=None):  # its rounding depends on the padded length
        out = real(q, k, v, attn_mask=attn_mask, scale=scale)
        return out + out * torch.finfo(out.dtype).eps * (k.shape[2] // BUCKET % 2)

    cpu = torch.device("cpu")
    assert pool_module._probe(torch.float32, 2, 2, 8, cpu, 1600)  # the real kernel, this CPU
    assert attention_free(torch.float32, 2, 2, 8, cpu, widest=3000)  # a pool of 3,000 slots: probed to 4,096
    assert any(key[-1] == 4096 for key in pool_module._FREE)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", padded_sum)
    assert not pool_module._probe(torch.float32, 2, 2, 8, cpu, 1600)
    assert not pool_module._probe(torch.float32, 2, 2, 8, cpu, 4096)


def test_the_pooled_call_is_transformers_sdpa_per_stream_head_for_head():
    # float64: the pooled call's head mapping and masks (a sliding window, a slot not in the step) are
    # transformers' own attention of each stream over its visible slots, to rounding
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = model_in("llama", torch.float32).model.layers[0].self_attn  # 4 query heads, 2 K/V heads
    gen = torch.Generator().manual_seed(5)
    pool = Pool()
    pool.windows = [None, 7]
    lengths = {0: [29, 29], 1: [3, 3], 2: [50, 50]}
    pool.keys = [torch.randn(3, 2, 128, 8, generator=gen, dtype=torch.float64) for _ in range(2)]
    pool.values = [torch.randn(3, 2, 128, 8, generator=gen, dtype=torch.float64) for _ in range(2)]
    pool.lengths, pool.added = lengths, {s: 0 for s in lengths}
    step = pool.step([2, 0])  # slot 1 not in this step
    query = torch.randn(1, 4, 2, 8, generator=gen, dtype=torch.float64)
    for layer, window in enumerate(pool.windows):
        got = step.attend(layer, query, 0.3)  # [2, H, D]
        for row, slot in enumerate([2, 0]):
            n = lengths[slot][layer] + 1
            start = 0 if window is None else n - window
            key, value = pool.keys[layer][slot, None, :, start:n], pool.values[layer][slot, None, :, start:n]
            own, _ = sdpa_attention_forward(module, query[:, :, row:row + 1], key, value, None, scaling=0.3)
            torch.testing.assert_close(got[row], own[0, 0], rtol=1e-13, atol=1e-13)


def test_a_long_stream_decodes_in_a_pool_of_its_own_with_the_answer_it_has_alone(monkeypatch):
    # one long stream among short ones would make every slot as long as it: pools by length class (each a call a
    # layer); a stream's attention is the same padded call whichever pool holds it (the padding probe)
    model = model_in("gemma3_text", torch.bfloat16)
    batch = requests(4)
    batch.insert(2, BatchRequest(prompt(600, seed=9)[0], max_new_tokens=4))
    scheduler = Scheduler(model, batch_settings(model, rows=ROWS))
    handles = [scheduler.submit(r) for r in batch]
    while scheduler.running < len(batch):
        scheduler.step()
    scheduler.step()
    pools = [job.stream.pool for job in scheduler._running]
    assert pools[2] is not pools[0] and all(p is pools[0] for p in pools[:2] + pools[3:])
    assert pools[0].keys[0].shape[2] < 600 <= pools[2].keys[0].shape[2]
    done = {e.handle: e.completion for e in scheduler.run() if isinstance(e, Done)}
    assert [(c.tokens, c.logprobs, c.top_logprobs) for c in (done[h] for h in handles)] == alone(model, batch)


def test_a_slot_past_its_room_grows_the_pool_and_keeps_every_slot():
    from transformers.cache_utils import DynamicCache, DynamicLayer

    gen = torch.Generator().manual_seed(1)
    caches = []
    for n in (5, 9):
        cache = DynamicCache()
        cache.layers = [DynamicLayer()]
        cache.layers[0].lazy_initialization(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
        cache.layers[0].keys, cache.layers[0].values = (torch.randn(1, 2, n, 4, generator=gen) for _ in range(2))
        caches.append(cache)
    originals = [(c.layers[0].keys.clone(), c.layers[0].values.clone()) for c in caches]
    pool = Pool()
    slots = [pool.join(c, room=0) for c in caches]
    assert pool.keys[0].shape[2] == BUCKET
    added = []
    for _ in range(BUCKET):  # past the room given, and past the buffers' length
        step = pool.step(slots)
        new = torch.randn(1, 2, 2, 4, generator=gen)
        step.append(0, new, -new)
        step.commit()
        added.append(new)
    assert pool.keys[0].shape[2] == 2 * BUCKET  # doubled
    for row, (slot, cache) in enumerate(zip(slots, caches, strict=True)):
        pool.leave(slot, cache)
        keys, values = originals[row]
        new = torch.cat([a[:, :, row:row + 1] for a in added], dim=2)
        assert torch.equal(cache.layers[0].keys, torch.cat([keys, new], dim=2))
        assert torch.equal(cache.layers[0].values, torch.cat([values, -new], dim=2))
    assert not pool.keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_with_their_own_caches_and_pooled_rows_share_a_step_with_the_answers_alone(monkeypatch, dtype):
    # a cache a pool cannot hold keeps its own room (kvstate.engine.room) and attends alone, in the same forward as
    # pooled rows; which streams are pooled is a property of each stream (here: its history's parity), as in use
    model = model_in("llama", dtype)
    real = Pool.poolable
    odd = staticmethod(lambda cache: real(cache) and cache.layers[0].keys.shape[-2] % 2 == 1)
    monkeypatch.setattr(Pool, "poolable", odd)
    batch = requests(6)  # histories of 3, 14, 25, ... tokens: odd ones pooled
    scheduler = Scheduler(model, batch_settings(model, rows=ROWS))
    handles = [scheduler.submit(r) for r in batch]
    while scheduler.running < len(batch):
        scheduler.step()
    scheduler.step()
    pooled = [job.stream.pool is not None for job in scheduler._running]
    assert any(pooled) and not all(pooled), pooled
    done = {e.handle: e.completion for e in scheduler.run() if isinstance(e, Done)}
    assert [(c.tokens, c.logprobs, c.top_logprobs) for c in (done[h] for h in handles)] == alone(model, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_static_shapes_attend_over_the_whole_capacity_with_the_bits_of_the_bucketed_call(monkeypatch, arch, dtype):
    # what a captured CUDA graph replays: one shape per pool buffer, whatever the streams' lengths
    seen: dict[bool, list[tuple]] = {True: [], False: []}
    real = pool_module.Step.attend

    def watched(self, layer, query, scaling, path=None):
        _, mask, L = self._group(layer)
        seen[self.pool.fixed].append((self.pool.keys[layer].data_ptr(), tuple(self.pool.keys[layer].shape),
                                      tuple(mask.shape), L))
        return real(self, layer, query, scaling, path)

    monkeypatch.setattr(pool_module.Step, "attend", watched)
    model = model_in(arch, dtype)
    batch = requests(6, new=9)  # lengths from 3 to 67 tokens: bucketed calls span 64 and 128 slots
    fixed = answers(model, batch, static_shapes=True)
    assert fixed == answers(model, batch) == alone(model, batch)
    assert seen[True] and seen[False]  # the pooled call ran both ways (the padding probe holds here)
    shapes: dict[int, set] = {}
    for pointer, buffer, mask, L in seen[True]:
        assert buffer[2] == L and mask == (buffer[0], 1, 1, buffer[2])  # every slot, the whole capacity
        shapes.setdefault(pointer, set()).add((mask, L))
    assert all(len(one) == 1 for one in shapes.values())  # between growths: one shape
    assert len({L for *_, L in seen[False]}) > 1  # the bucketed call's length follows the longest stream


def test_the_math_kernel_of_the_pooled_call_is_sdpa_to_rounding():
    # on CUDA the pooled call runs aten's math kernel (never PyTorch's pick); its additive mask is the boolean one
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 4, 8, generator=gen, dtype=torch.float64)
    keys, values = (torch.randn(3, 2, 128, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = pool_module.visible([5, 128, 70], 128, None, "cpu")
    mask[0, ..., 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.3)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel_rule, "MATH_DEVICES", {"cpu"})
        path = kernel_rule.choose("cpu", q.dtype, 8, "none", groups=2, decode="pooled", free=lambda _: True)
        got = pool_module.pooled_sdpa(q, keys, values, mask, 0.3, path)
    assert path == kernel_rule.Path("math", "dense", "pooled")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_with_the_math_kernel_the_pooled_call_keeps_batched_equal_alone(monkeypatch, dtype):
    # CUDA's pooled path run on the CPU: the padding probe is run on the math kernel, and the answers stay alone's
    monkeypatch.setattr(kernel_rule, "MATH_DEVICES", {"cpu"})
    monkeypatch.setattr(pool_module, "_FREE", {})
    calls, real = [], pool_module.pooled_sdpa
    monkeypatch.setattr(pool_module, "pooled_sdpa", lambda *a: calls.append(1) or real(*a))
    model = model_in("gemma3_text", dtype)  # sliding and full layers
    attention = model.model.layers[0].self_attn
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    batch = requests(5)
    assert answers(model, batch) == alone(model, batch)
    free = attention_free(dtype, kv_heads, heads // kv_heads, attention.head_dim, torch.device("cpu"))
    probed = len(calls)
    assert probed > 0  # the probe itself ran on the math kernel
    calls.clear()
    answers(model, batch, static_shapes=True)
    assert bool(calls) is free  # the pooled call ran exactly where the math kernel passed the probe
