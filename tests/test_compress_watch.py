"""Look-ahead policies, question-aware compression, ratio semantics, compression during generate.

Exactness of KVzip and ExpectedAttention against the hand-made masked reference is in
``test_compress.py`` (they are in its policy table); here: their scoring facts, the
watch that feeds them, save/load/fork of their states, and the budgeted ``generate``
against the manual reference (``decode_with_budget``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate import Session
from kvstate.compress import (
    TOVA,
    ExpectedAttention,
    KNorm,
    KVzip,
    ScoreInput,
    SnapKV,
    StreamingLLM,
    decode_with_budget,
)
from kvstate.compress.observe import reconstruction, unrotate, watch
from kvstate.errors import InputError, UnsupportedError
from test_compress import check_against_reference, masked_reference
from tiny import WINDOW, prompt, tiny_model


# ----- the watch ------------------------------------------------------------------------------------
def test_watched_queries_are_the_models_own_queries_before_rope():
    """Undoing RoPE on the watched queries gives exactly what ``q_proj`` produced."""
    model = tiny_model("llama")
    raw = {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, a, out, i=i: raw.__setitem__(i, out))
             for i, layer in enumerate(model.model.layers)]
    s = Session(model)
    s.extend(prompt(30))
    seen, tail = watch(s._engine, model, s.state, ExpectedAttention(window=6).needs(), None)
    for h in hooks:
        h.remove()
    assert tail == 6
    for i, layer_seen in seen.items():
        queries = layer_seen.query_block()
        expected = raw[i].view(1, 6, -1, queries.shape[-1]).transpose(1, 2)
        assert (queries - expected).abs().max() <= 1e-5 * expected.abs().max(), i


def test_unrotate_divides_out_a_rope_scale():
    """YaRN-style tables carry a scale (cos^2 + sin^2 != 1); un-rotation still recovers the query."""
    q = torch.randn(1, 2, 3, 8)
    angles = torch.rand(1, 3, 4) * 6
    scale = 1.3
    cos = torch.cat([angles.cos(), angles.cos()], -1) * scale
    sin = torch.cat([angles.sin(), angles.sin()], -1) * scale
    half = torch.cat([-q[..., 4:], q[..., :4]], -1)
    rotated = q * cos[:, None] + half * sin[:, None]
    assert torch.allclose(unrotate(rotated, (cos, sin)), q, atol=1e-5)
    # partial RoPE: only the first half of the dims rotate
    c2, s2 = torch.cat([angles.cos()[..., :2]] * 2, -1), torch.cat([angles.sin()[..., :2]] * 2, -1)
    h2 = torch.cat([-q[..., 2:4], q[..., :2]], -1)
    partial = torch.cat([q[..., :4] * c2[:, None] + h2 * s2[:, None], q[..., 4:]], -1)
    assert torch.allclose(unrotate(partial, (c2, s2)), q, atol=1e-5)


def test_question_aware_watch_sees_the_question_and_does_not_feed_it():
    model = tiny_model("gemma3_text")
    s = Session(model)
    s.extend(prompt(40))
    before = s.state
    question = prompt(6, seed=9)
    seen, tail = watch(s._engine, model, before, SnapKV(window=4).needs(), question)
    assert tail == 0 and s.state is before
    for i, layer_seen in seen.items():
        rows = layer_seen.attention()
        assert rows.shape[2] == 6 and rows.shape[-1] == before.layers[i].slots
        assert (rows.sum(-1) <= 1 + 1e-5).all()  # mass on the state's slots; the rest went to the question
    s.compress(SnapKV(0.5, window=4, kernel=3), query_ids=question)
    assert s.state.tokens_seen == 40 and torch.equal(s.state.tokens, before.tokens)
    seq = torch.cat([prompt(40), question], 1)
    ref = masked_reference(model, seq, s.state, 40)
    from tiny import assert_logits_close

    assert_logits_close(s.extend(question), ref, "question-aware SnapKV")


def test_question_aware_and_agnostic_choose_differently():
    model = tiny_model("llama")
    s = Session(model)
    s.extend(prompt(40))
    aware, agnostic = s.fork(), s.fork()
    aware.compress(TOVA(0.5), query_ids=prompt(5, seed=11))
    agnostic.compress(TOVA(0.5))
    assert not torch.equal(aware.state.layers[0].positions, agnostic.state.layers[0].positions)


def test_query_ids_are_refused_where_they_would_be_ignored_or_do_not_fit():
    s = Session(tiny_model("llama"))
    s.extend(prompt(20))
    with pytest.raises(InputError, match="does not look at queries"):
        s.compress(KNorm(0.5), query_ids=prompt(3))
    with pytest.raises(InputError):
        s.compress(SnapKV(0.5, window=4), query_ids=torch.cat([prompt(3), prompt(3)]))
    with pytest.raises(InputError, match="sliding-window meaning"):
        s.compress(KNorm(0.5), sliding="kvpress")
    with pytest.raises(InputError, match="KVzip prompt"):
        KVzip(0.5, prompt=("a",))


# ----- scoring facts -----------------------------------------------------------------------------------
def test_reconstruction_chunks_follow_kvzip():
    tokens = torch.arange(100, 150)[None]
    feeds = reconstruction(tokens, (1, 2), chunk=20)
    assert [f.shape[1] for f in feeds] == [22, 30, 20]
    assert feeds[0][0].tolist() == [1, 2, *range(100, 120)]
    assert feeds[1][0].tolist() == [1, 2, *range(112, 140)]  # after the last 8 tokens of the chunk before


def test_expected_attention_is_the_softmax_of_the_rotated_mean_query():
    """Without covariance, one future position and no value norm, the score is the attention a query
    equal to the mean watched query would pay at that position."""
    torch.manual_seed(0)
    B, H, S, D, W = 1, 2, 10, 8, 5
    keys, queries = torch.randn(B, H, S, D), torch.randn(B, H, W, D)
    angle = torch.rand(D // 2) * 3
    future = (torch.cat([angle.cos()] * 2), torch.cat([angle.sin()] * 2))
    x = ScoreInput(0, 1, keys, torch.arange(S)[None] + 10, values=torch.ones(B, H, S, D), queries=queries,
                   future=future, scaling=0.5)
    old = dict(heads=False, scope="layer", epsilon=0.0)  # kvstate's earlier ExpectedAttention: one slot set per layer
    got = ExpectedAttention(0.5, window=W, sinks=0, covariance=False, vnorm=False, **old).scores(x)
    mu = queries.mean(2)
    rotated = mu * future[0] + torch.cat([-mu[..., D // 2:], mu[..., : D // 2]], -1) * future[1]
    expected = (0.5 * torch.einsum("bhd,bhsd->bhs", rotated, keys)).softmax(-1).mean(1)
    assert torch.allclose(got, expected, atol=1e-6)
    with_cov = ExpectedAttention(0.5, window=W, sinks=2, **old).scores(x)
    assert with_cov.shape == (B, S) and torch.isfinite(with_cov).all()


def test_kvzip_scores_the_peak_attention_and_keeps_sinks():
    peak = torch.tensor([[[0.1, 0.9, 0.2, 0.05], [0.3, 0.1, 0.8, 0.05]]])  # [B, Hq, S]
    x = ScoreInput(0, 1, torch.randn(1, 1, 4, 8), torch.arange(4)[None], peak=peak)
    expected = torch.tensor([[float("inf"), 0.9, 0.8, 0.05]])
    old = dict(softmax="model", heads=False, scope="layer")  # kvstate's earlier KVzip: the model's attention peak
    assert torch.equal(KVzip(0.5, sinks=1, **old).scores(x), expected)


# ----- ratio semantics -------------------------------------------------------------------------------
def test_context_semantics_count_the_budget_against_the_whole_context():
    model = tiny_model("gemma3_text")
    T = 4 * WINDOW
    s = Session(model)
    s.extend(prompt(T))
    within, kvpress = s.fork(), s.fork()
    within.compress(KNorm(0.5))
    kvpress.compress(KNorm(0.5), sliding="context")
    for i, layer in enumerate(s.state.layers):
        if layer.window is None:
            assert within.state.layers[i].slots == kvpress.state.layers[i].slots == T - T // 2
        else:  # the window (11 slots) is within a budget of 24: untouched under the kvpress meaning
            assert kvpress.state.layers[i] is layer
            assert within.state.layers[i].slots == (WINDOW - 1) - (WINDOW - 1) // 2
    check_against_reference("gemma3_text", KNorm(0.8))  # and a budget below the window, which cuts it


# ----- save, load, fork ------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [KVzip(0.5, prompt=(3, 4), chunk=16), ExpectedAttention(0.5, window=4)],
                         ids=["kvzip", "expected"])
def test_lookahead_states_save_load_and_fork_exactly(policy, tmp_path):
    model = tiny_model("gemma3_text")
    s = Session(model)
    s.extend(prompt(3 * WINDOW))
    s.compress(policy)
    twin = s.fork()
    s.save(tmp_path / "c.kvs")
    more = prompt(4, seed=6)
    expected = s.extend(more)
    assert torch.equal(twin.extend(more), expected)
    fresh = Session.load(tmp_path / "c.kvs", tiny_model("gemma3_text"))
    assert torch.equal(fresh.extend(more), expected)


# ----- compression during generate --------------------------------------------------------------------------
def _slots_seen(model):
    """Forward pre-hook recording the most slots any attention layer held during each decoding forward
    (not the scoring forwards of the watch, whose state is thrown away)."""
    from kvstate._compat import core as _compat_core
    from kvstate._compat.watch import NAME

    name = _compat_core.cache_kwarg(model)
    peak = [0]

    def hook(_module, args, kwargs):
        cache, ids = kwargs.get(name), kwargs.get("input_ids")
        if cache is not None and ids is not None and _compat_core.attention_implementation(model) != NAME:
            held = [layer.keys.shape[-2] for layer in cache.layers if getattr(layer, "keys", None) is not None
                    and layer.keys.numel()]
            peak[0] = max(peak[0], max(held, default=0) + ids.shape[1])
    return peak, hook


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_generate_with_compression_equals_the_manual_reference_within_budget(arch):
    """Acceptance 3: 512 generated tokens on a budget of 256 slots, exactly the manual reference."""
    model = tiny_model(arch)
    ids = prompt(40)
    manual = decode_with_budget(Session(model), ids, KVzip(prompt=(3, 4)), budget=256, every=32,
                                max_new_tokens=512)
    s = Session(model)
    peak, hook = _slots_seen(model)
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        got = s.generate(ids, compress=KVzip(prompt=(3, 4)), budget=256, every=32, max_new_tokens=512,
                         do_sample=False)
    finally:
        handle.remove()
    assert torch.equal(got, manual) and got.shape == (1, 512)
    assert 0 < peak[0] <= 256
    assert all(layer.slots <= 256 for layer in s.state.layers if layer.keys is not None)
    assert s.state.tokens_seen == 40 + 511 and s.state.next_position.item() == 551  # true positions


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(budget=st.integers(12, 40), every=st.integers(3, 11), n=st.integers(1, 40),
       policy=st.sampled_from([KNorm(), StreamingLLM(sinks=2), TOVA(), ExpectedAttention(window=3),
                               SnapKV(window=3, kernel=3)]))
def test_budgeted_generate_matches_manual_for_any_budget(budget, every, n, policy):
    model = tiny_model("llama")
    ids = prompt(20)
    manual = decode_with_budget(Session(model), ids, policy, budget=budget, every=every, max_new_tokens=n)
    got = Session(model).generate(ids, compress=policy, budget=budget, every=every, max_new_tokens=n,
                                  do_sample=False)
    assert torch.equal(got, manual)


def test_budgeted_generate_refuses_before_running_and_is_transactional():
    from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, TextStreamer

    model = tiny_model("llama")
    s = Session(model)
    s.extend(prompt(20))
    before = s.state
    history = torch.cat([prompt(20), prompt(3, seed=2)], 1)
    for bad, kind in ((dict(budget=8, every=8), InputError), (dict(budget=16, every=4, streamer=TextStreamer(None)),
                                                              UnsupportedError),
                      (dict(budget=16, every=2, compress=SnapKV(window=4)), InputError),
                      (dict(budget=16, every=4, generation_config=GenerationConfig(min_new_tokens=3)),
                       UnsupportedError),  # set through a config counts as set by keyword
                      (dict(budget=16, every=4, return_dict_in_generate=True), UnsupportedError),
                      (dict(budget=16, every=4, stop_strings=["x"]), UnsupportedError)):
        with pytest.raises(kind):
            s.generate(history, **{"compress": KNorm(), "max_new_tokens": 20, **bad})
        assert s.state is before

    class Boom(LogitsProcessor):
        calls = 0

        def __call__(self, ids, scores):
            Boom.calls += 1
            if Boom.calls == 9:
                raise KeyboardInterrupt
            return scores

    with pytest.raises(KeyboardInterrupt):
        s.generate(history, compress=KNorm(), budget=16, every=4, max_new_tokens=20,
                   logits_processor=LogitsProcessorList([Boom()]))
    assert s.state is before
    with pytest.raises(UnsupportedError, match="one row"):
        Session(model).generate(torch.cat([prompt(20), prompt(20, seed=3)]), compress=KNorm(), budget=16, every=4,
                                max_new_tokens=8)


def test_budgeted_generate_stops_at_end_of_sequence():
    model = tiny_model("llama")
    ids = prompt(20)
    free = Session(model).generate(ids, max_new_tokens=12, do_sample=False)
    eos = int(free[0, 5])
    got = Session(model).generate(ids, compress=KNorm(), budget=1000, every=4, max_new_tokens=12, do_sample=False,
                                  eos_token_id=eos)
    assert got[0, -1].item() == eos and got.shape[1] <= 6


def test_expected_attention_discounts_slots_leaving_a_sliding_window():
    """Two slots with the same key: the one that leaves the window first is worth less."""
    keys = torch.ones(1, 1, 3, 4)
    x = ScoreInput(0, 1, keys, torch.tensor([[90, 95, 99]]), values=torch.ones(1, 1, 3, 4),
                   queries=torch.ones(1, 1, 2, 4), scaling=0.5, window=12, horizon=(100, 10))
    scores = ExpectedAttention(0.5, window=2, sinks=0, covariance=False, heads=False, scope="layer").scores(x)[0]
    assert scores[0] < scores[1] < scores[2]
    assert torch.allclose(scores / scores[2], torch.tensor([0.2, 0.7, 1.0]))


@pytest.mark.parametrize("arch", ["lfm2", "jamba"])
def test_kvzip_on_hybrids_scores_attention_layers_and_stays_exact(arch):
    """The re-read runs through recurrent layers too (one token per forward where needed); only the
    attention layers are scored and compressed, and the continuation is exact."""
    check_against_reference(arch, KVzip(0.5, prompt=(3, 4), chunk=16))


def test_expected_attention_refuses_multimodal_positions_and_unrollable_states():
    s = Session(tiny_model("qwen3_vl"))
    s.extend(prompt(30))
    with pytest.raises(UnsupportedError, match="1-D positions"):
        s.compress(ExpectedAttention(0.5, window=4))
    hybrid = Session(tiny_model("lfm2"))
    hybrid.extend(prompt(30))
    with pytest.raises(UnsupportedError, match="cannot roll back"):
        hybrid.compress(ExpectedAttention(0.5, window=4))
    hybrid.compress(ExpectedAttention(0.5, window=4), query_ids=prompt(3))  # a question needs no rollback
    assert hybrid.state.tokens_seen == 30
