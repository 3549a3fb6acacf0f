"""Prefill chunks in tiles, alone or packed with other prompts' chunks, with the same bits.

``Session(prefill_rows=R)`` runs each prefill chunk as a tiled forward (``kvstate.engine.batched.prefill``);
``Session.extend_many`` (what ``kvstate.batch`` admits prompts with) packs the chunks of a round into
one forward. Hypothesis drives the prompt lengths, the states they continue, the canonical chunk and
the tile, on a llama and a gemma3_text (sliding window shorter than the histories) in float32 and
bfloat16: every packed state must equal the state its own ``extend`` gives, bitwise. Independent
oracles: greedy tokens equal plain ``model.generate``'s, and the states record their kernels, so a
session of other kernels feeds them again instead of reusing them.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate import Session
from kvstate.batch import BatchRequest, Done, Scheduler, batch_settings
from kvstate.engine.batched import prefill
from kvstate.errors import ScheduleWarning
from tiny import assert_same_state, prompt, tiny_model


@functools.cache
def model_in(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    return tiny_model(arch).to(dtype)


EXAMPLES = int(os.environ.get("KVSTATE_BATCH_EXAMPLES", "6"))  # the recorded stress run: 50
PROMPT = st.fixed_dictionaries({"before": st.integers(0, 70), "length": st.integers(1, 60), "seed": st.integers(0, 99)})


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(specs=st.lists(PROMPT, min_size=1, max_size=6), chunk=st.sampled_from([8, 24, 64]),
       rows=st.sampled_from([4, 32]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_packed_chunks_are_each_sessions_own_extend_bitwise(arch, dtype, specs, chunk, rows):
    model = model_in(arch, dtype)
    made = dict(canonical_chunk=chunk, prefill_rows=rows)

    def started(spec: dict) -> Session:
        session = Session(model, **made)
        if spec["before"]:  # a state that continues a history (past keys; beyond the sliding window)
            session.extend(prompt(spec["before"], seed=spec["seed"] + 100))
        return session

    news = [prompt(spec["length"], seed=spec["seed"]) for spec in specs]
    packed = [started(spec) for spec in specs]
    Session.extend_many(packed, news)
    for spec, ids, session in zip(specs, news, packed, strict=True):
        alone = started(spec)
        alone.extend(ids)
        assert_same_state(session.state, alone.state)
        assert session.state.canonical_device == f"cpu+tile{rows}"


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_vl"])
def test_a_tiled_session_answers_as_plain_generate_and_resumes_only_its_own_kernels(arch, tmp_path):
    model = model_in(arch, torch.float32)
    ids = prompt(150, seed=1)
    options = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    tiled = Session(model, prefill_rows=32)
    first = tiled.generate(ids, **options)
    plain = model.generate(ids, max_new_tokens=6, do_sample=False)[:, ids.shape[1]:]
    assert torch.equal(first.sequences, plain)  # an independent oracle: the tokens plain transformers gives
    turn = torch.cat([ids, first.sequences, prompt(20, seed=2)], dim=1)
    tiled.save(tmp_path / "chat.kvstate")
    loaded = Session.load(tmp_path / "chat.kvstate", model)  # the file names its kernels: the tile is kept
    cold = Session(model, prefill_rows=32).generate(turn, **options)
    for session in (tiled, loaded):
        warm = session.generate(turn, **options)
        assert torch.equal(warm.sequences, cold.sequences) and torch.equal(torch.cat(warm.logits),
                                                                          torch.cat(cold.logits))
        assert session.last_plan.reused == 128 and session.settings.prefill_rows == 32
    adopted = Session(model, state=loaded.state)  # a state given without a schedule continues under its own
    assert adopted.settings.prefill_rows == 32
    assert adopted.generate(turn, **options).sequences.equal(cold.sequences) and adopted.last_plan.reused == 128
    for rows in (0, 16):
        with pytest.warns(ScheduleWarning, match="fed again"):  # told other kernels: it says why nothing is reused
            other = Session(model, state=loaded.state, prefill_rows=rows)
        warm = other.generate(turn, **options)  # other kernels: nothing is reused, the answer is its cold one
        cold = Session(model, prefill_rows=rows).generate(turn, **options)
        assert other.last_plan.reused == 0 and torch.equal(torch.cat(warm.logits), torch.cat(cold.logits))


def test_a_step_admits_its_prompts_in_one_packed_forward_and_defers_a_shared_chunk(monkeypatch):
    model = model_in("llama", torch.float32)
    forwards: list[int] = []
    run = prefill.Tiled.run
    monkeypatch.setattr(prefill.Tiled, "run",
                        lambda self, engine, pieces: forwards.append(len(pieces)) or run(self, engine, pieces))
    scheduler = Scheduler(model, batch_settings(model, rows=4, canonical_chunk=8))
    system = prompt(16, seed=5)[0]  # two whole chunks shared by the last two prompts
    requests = [BatchRequest(prompt(5 + 3 * i, seed=i)[0], max_new_tokens=2) for i in range(4)]
    requests += [BatchRequest(torch.cat([system, prompt(4 + i, seed=9 + i)[0]]), max_new_tokens=2) for i in range(2)]
    assert prefill.tiled_for(scheduler.engine, 32).usable(scheduler.engine)  # the probe's forward, before counting
    forwards.clear()
    for request in requests:
        scheduler.submit(request)
    first = scheduler.step()
    # the four short prompts (5, 8, 11, 14 tokens) and the first with the system prompt (20) in rounds of one forward
    # each: chunks of 8 make 5, then 3, then 1 pieces. The second waits a step: it shares two chunks with the first
    assert forwards == [5, 3, 1] and len({e.handle for e in first}) == 5
    forwards.clear()
    second = scheduler.step()
    assert forwards == [1]  # only its own chunk: the shared system prompt came from the first one's state
    done = [e.completion for e in [*first, *second, *scheduler.run()] if isinstance(e, Done)]
    assert len(done) == 6 and sorted(c.reused for c in done) == [0, 0, 0, 0, 0, 16]


def test_the_head_runs_in_the_decodes_tile_and_the_body_in_the_prefills():
    from kvstate.engine.batched import kernels

    if not kernels.available():
        pytest.skip("this torch has no oneDNN linear kernels")
    model = tiny_model("llama")  # fresh weights: nothing prepacked yet
    Session(model, prefill_rows=32).extend(prompt(40, seed=3))
    head = model.get_output_embeddings()
    body = [m for m in model.modules() if type(m) is torch.nn.Linear and m is not head]
    # one row per prompt reaches the head: its tile is the packed decode's (16), whose prepacked copy serves both
    assert set(kernels._held(head.weight)) == {16} and all(set(kernels._held(m.weight)) == {32} for m in body)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_after_the_probe_the_tiled_prefill_skips_the_tiling_mode_with_the_same_bits(arch):
    from kvstate.engine.batched import kernels

    if not kernels.available():
        pytest.skip("this torch has no oneDNN linear kernels: the tiling mode computes the tiles")
    model = model_in(arch, torch.bfloat16)
    session = Session(model, prefill_rows=32)
    session.extend(prompt(70, seed=4))
    tiles = prefill.tiled_for(session._engine, 32)
    assert tiles.plain  # the probe's census: every product ran on prepacked weights, none in the mode
    tiles.plain = False  # the mode on again, as in the probe: the same calls, so the same bits
    try:
        pinned = Session(model, prefill_rows=32)
        pinned.extend(prompt(70, seed=4))
    finally:
        tiles.plain = True
    assert_same_state(session.state, pinned.state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_after_the_census_a_prefill_runs_all_its_rows_in_one_call_with_the_tiles_bits(dtype, monkeypatch):
    # oneDNN's prepacked kernels give a row the bits of its tile for any row count (probed per count, rows_free),
    # so the body's products take all rows at once: the weights read once, not once a tile
    from kvstate.engine.batched import kernels

    if not kernels.available():
        pytest.skip("this torch has no oneDNN linear kernels")
    model = model_in("llama", dtype)
    calls = []
    used = prefill.prepacked
    monkeypatch.setattr(prefill, "prepacked", lambda k, rows, *a: calls.append(rows) or used(k, rows, *a))
    ids = [prompt(40 + 17 * i, seed=20 + i) for i in range(3)]
    one = [Session(model, prefill_rows=32, canonical_chunk=128) for _ in ids]
    Session.extend_many(one, ids)  # 40 + 57 + 74 rows, padded to 192: one call of 192 rows
    assert calls[-1] == 192, calls
    monkeypatch.setattr(prefill.Tiled, "_calls", lambda self, k, P, heads: (self.rows, self.own_rows))
    tiles = [Session(model, prefill_rows=32, canonical_chunk=128) for _ in ids]
    Session.extend_many(tiles, ids)
    assert calls[-1] == 32
    for a, b in zip(one, tiles, strict=True):
        assert_same_state(a.state, b.state)
