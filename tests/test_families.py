"""Model-side and recurrent state: Qwen-VL, RecurrentGemma, SSM and linear-attention hybrids."""

from __future__ import annotations

import pytest
import torch

from kvstate import Session
from kvstate._compat import core as _compat_core
from kvstate._compat.scan import available as scan_available
from kvstate.errors import EmptyStateError, RollbackError
from kvstate.testing.tiny import IMAGE_TOKEN, QWEN_VL, RECURRENT, image_span, tiny_image
from tiny import assert_logits_close, prompt, tiny_model

FAMILIES = [*RECURRENT, *QWEN_VL]
N_NEW = 16


def conversation(arch: str, seed: int = 1, image_seed: int = 0):
    """(ids, image inputs): text, an image for Qwen-VL, more text. Image inputs are {} otherwise."""
    if arch not in QWEN_VL:
        return prompt(30, seed=seed), {}
    pixels, grid, n = tiny_image((4, 6), seed=image_seed)
    ids = torch.cat([prompt(8, seed=seed), image_span(n), prompt(12, seed=seed + 1)], 1)
    return ids, {"pixel_values": pixels, "image_grid_thw": grid}


def plain_inputs(ids, inputs):
    """What plain transformers needs for the same history: Qwen-VL wants the image token types."""
    return {**inputs, "mm_token_type_ids": (ids == IMAGE_TOKEN).int()} if inputs else {}


def reference(model, ids, inputs, n=N_NEW):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, **plain_inputs(ids, inputs))
    return out.sequences[:, ids.shape[1]:], out.logits[0]


def resume(session, ids, inputs, n=N_NEW):
    out = session.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                           output_logits=True, **inputs)
    return out.sequences, out.logits[0]


@pytest.fixture(params=FAMILIES)
def arch(request):
    return request.param


def test_split_resume_equals_full_run(arch):
    """The longest-prefix planner (``canonical_chunk=0``); tests/test_schedule.py holds the canonical twin."""
    model = tiny_model(arch)
    ids, inputs = conversation(arch)
    ref_tokens, ref_logits = reference(model, ids, inputs)
    s = Session(model, canonical_chunk=0)
    s.extend(ids[:, :-6], **inputs)  # the image, if any, is in the prefix
    tokens, logits = resume(s, ids, inputs)  # pixels passed again: must not be re-processed
    assert s.last_plan.mode == "continue" and s.last_plan.fed == 6
    assert torch.equal(tokens, ref_tokens)
    assert_logits_close(logits, ref_logits, "first step")


def test_reset_is_bitwise_fresh(arch):
    first, first_inputs = conversation(arch, seed=3, image_seed=5)
    second = prompt(18, seed=4)
    s = Session(tiny_model(arch))
    s.generate(first, max_new_tokens=4, do_sample=False, **first_inputs)
    s.reset()
    logits = s.extend(second[:, :-3])
    tokens, step = resume(s, second, {})
    fresh = Session(tiny_model(arch))
    assert torch.equal(logits, fresh.extend(second[:, :-3]))
    fresh_tokens, fresh_step = resume(fresh, second, {})
    assert torch.equal(step, fresh_step) and torch.equal(tokens, fresh_tokens)


def test_state_moves_to_a_fresh_instance(arch):
    ids, inputs = conversation(arch)
    s = Session(tiny_model(arch))
    s.extend(ids[:, :-6], **inputs)
    moved = Session(tiny_model(arch), state=s.state)  # same weights, new object, no model-side state
    tokens, logits = resume(moved, ids, inputs)
    same_tokens, same_logits = resume(s, ids, inputs)
    assert torch.equal(logits, same_logits) and torch.equal(tokens, same_tokens)
    assert torch.equal(tokens, reference(tiny_model(arch), ids, inputs)[0])


def test_fork_independence(arch):
    ids, inputs = conversation(arch)
    a = torch.cat([ids, prompt(5, seed=11)], 1)
    b = torch.cat([ids, prompt(7, seed=12)], 1)
    model = tiny_model(arch)
    s = Session(model, canonical_chunk=8)
    s.extend(ids, **inputs)
    f = s.fork()
    tokens_a = s.generate(a, max_new_tokens=8, do_sample=False)
    tokens_b = f.generate(b, max_new_tokens=8, do_sample=False)
    assert torch.equal(tokens_a, reference(model, a, inputs, 8)[0])
    assert torch.equal(tokens_b, reference(model, b, inputs, 8)[0])


@pytest.mark.parametrize("arch", RECURRENT)
def test_checkpoints_allow_divergent_history(arch):
    model = tiny_model(arch)
    base = prompt(20)
    s = Session(model, canonical_chunk=0)  # call-boundary checkpoints (the canonical ones sit on its cuts)
    s.extend(base)  # checkpoint at 20
    s.generate(base, max_new_tokens=6, do_sample=False)  # checkpoint at 25
    assert [c.tokens_seen for c in s.state.checkpoints] == [20, 25]
    other = torch.cat([base, prompt(4, seed=9)], 1)  # diverges at 20: back to that checkpoint
    tokens = s.generate(other, max_new_tokens=8, do_sample=False)
    assert s.last_plan.mode == "checkpoint" and s.last_plan.reused == 20
    assert torch.equal(tokens, reference(model, other, {}, 8)[0])


@pytest.mark.parametrize("arch", RECURRENT)
def test_truncate_to_checkpoint_only(arch):
    model = tiny_model(arch)
    ids = prompt(24)
    s = Session(model)
    s.extend(ids[:, :12])
    s.extend(ids[:, 12:])
    with pytest.raises(RollbackError) as info:
        s.truncate(15)
    assert "checkpoints exist at [12, 24]" in str(info.value)
    s.truncate(12)
    logits = s.extend(prompt(3, seed=5))
    assert_logits_close(logits, Session(model).extend(torch.cat([ids[:, :12], prompt(3, seed=5)], 1)))


def test_checkpoints_are_capped():
    s = Session(tiny_model("lfm2"), max_checkpoints=2)
    for i in range(4):
        s.extend(prompt(3, seed=i))
    assert [c.tokens_seen for c in s.state.checkpoints] == [9, 12]
    assert s.state.summary()["checkpoint_nbytes"] > 0


def test_checkpoint_every_n_tokens():
    s = Session(tiny_model("qwen3_next"), checkpoint_every=8, canonical_chunk=0)
    s.extend(prompt(20))
    assert [c.tokens_seen for c in s.state.checkpoints] == [8, 16, 20]
    canonical = Session(tiny_model("qwen3_next"), canonical_chunk=8)  # checkpoints on the schedule's cuts
    canonical.extend(prompt(20))
    assert [c.tokens_seen for c in canonical.state.checkpoints] == [8, 16, 20]


def test_recurrent_gemma_needs_its_prefix():
    s = Session(tiny_model("recurrent_gemma"))
    with pytest.raises(EmptyStateError):
        s.extend(prompt(3), position_ids=torch.tensor([[7, 8, 9]]))  # seed 002: pos > 0, nothing cached


def test_recurrent_gemma_chunked_prefill_and_lost_conv_context():
    """transformers zero-pads the conv window on multi-token continuations; kvstate stays exact."""
    model = tiny_model("recurrent_gemma")
    ids = prompt(24)
    single = Session(model).extend(ids)
    assert_logits_close(Session(model, chunk_size=5).extend(ids), single, "chunked")
    with torch.no_grad():  # the plain path: a cache-carrying 8-token continuation
        from transformers import DynamicCache

        cache = {_compat_core.cache_kwarg(model): DynamicCache(config=model.config)}
        model(ids[:, :16], **cache, use_cache=True)
        try:
            plain = model(ids[:, 16:], **cache, use_cache=True,
                          position_ids=torch.arange(16, 24)[None]).logits[:, -1]
        except RuntimeError:  # 5.18 - 5.22 size the window's mask for fewer keys than they return
            plain = None
    assert plain is None or (plain - single).abs().max() > 1e-3  # transformers' own path drifts, or crashes
    s = Session(model)
    s.extend(ids[:, :16])
    assert_logits_close(s.extend(ids[:, 16:]), single, "kvstate continuation")


@pytest.mark.skipif(not scan_available("transformers.models.mamba.modeling_mamba"),
                    reason="this transformers' Mamba has no selective-scan function: chunks go one token per forward")
def test_mamba_continues_a_chunk_in_one_forward_from_the_cached_scan_state():
    """transformers 5.24 starts Mamba's selective scan from zeros on a multi-token chunk; kvstate
    hands it the cached state, so a 27-token turn is one forward and equals the whole run."""
    from tiny import count_forwards

    model = tiny_model("mamba")
    ids = prompt(40)
    single = Session(model, canonical_chunk=0).extend(ids)
    with torch.no_grad():  # the plain path: a cache-carrying continuation
        cache = getattr(model(ids[:, :13], use_cache=True), _compat_core.cache_kwarg(model))
        plain = model(ids[:, 13:], **{_compat_core.cache_kwarg(model): cache}, use_cache=True).logits[:, -1]
    assert (plain - single).abs().max() > 1e-4  # transformers' own path drifts here
    s = Session(model, canonical_chunk=0)
    s.extend(ids[:, :13])
    with count_forwards(model) as forwards:
        logits = s.extend(ids[:, 13:])
    assert forwards[0] == 1
    # the same sequential recurrence; the projections run on 27 rows instead of 40, which CPU kernels may
    # round differently (only the same shapes are bitwise), so: the project tolerance, 100x under
    # the drift of transformers' own path above
    assert_logits_close(logits, single, "27-token chunk from the cached scan state")


@pytest.mark.parametrize("arch", QWEN_VL)
def test_second_image_after_resume(arch):
    model = tiny_model(arch)
    ids, inputs = conversation(arch)
    pixels2, grid2, n2 = tiny_image((6, 4), seed=7)
    full = torch.cat([ids, image_span(n2), prompt(5, seed=13)], 1)
    both = {"pixel_values": torch.cat([inputs["pixel_values"], pixels2]),
            "image_grid_thw": torch.cat([inputs["image_grid_thw"], grid2])}
    s = Session(model)
    s.extend(ids, **inputs)
    tokens, logits = resume(s, full, both)  # both images passed; only the second is fed
    ref_tokens, ref_logits = reference(model, full, both)
    assert torch.equal(tokens, ref_tokens)
    assert_logits_close(logits, ref_logits, "after the second image")
    second = Session(tiny_model(arch))
    second.extend(ids, **inputs)
    step = second.extend(full[:, ids.shape[1]:], pixel_values=pixels2, image_grid_thw=grid2)
    assert_logits_close(step, model(full, **plain_inputs(full, both)).logits[:, -1], "extend with image")


@pytest.mark.parametrize("arch", QWEN_VL)
def test_rope_deltas_are_state_and_reset_clears_them(arch):
    model = tiny_model(arch)
    ids, inputs = conversation(arch)
    s = Session(model)
    s.extend(ids, **inputs)
    deltas = s.state.extras["rope_deltas"]
    assert deltas.tolist() == [[int(s.state.next_position) - ids.shape[1]]] and deltas.item() < 0
    assert torch.equal(model.model.rope_deltas, deltas)
    s.reset()
    assert model.model.rope_deltas is None


def test_qwen3_vl_control_table():
    """The long seed's table, rebuilt: only kvstate's restored state reproduces the reference."""
    ids, inputs = conversation("qwen3_vl")
    prefix, last = ids[:, :-1], ids[:, -1:]
    reference_logits = tiny_model("qwen3_vl")(ids, **plain_inputs(ids, inputs)).logits[:, -1]
    s = Session(tiny_model("qwen3_vl"))
    s.extend(prefix, **inputs)
    rows = {"kvstate restored": Session(tiny_model("qwen3_vl"), state=s.state).extend(last)}
    true_delta = s.state.extras["rope_deltas"]
    for name, delta in {"rope_deltas None": None, "rope_deltas 0": torch.zeros_like(true_delta),
                        "rope_deltas +1": true_delta + 1, "rope_deltas correct": true_delta}.items():
        model = tiny_model("qwen3_vl")  # plain transformers on a fresh instance, same K/V and mask
        model.model.rope_deltas = delta
        cache = _compat_core.build_cache(s.state.layers, model.config)
        with torch.no_grad():
            rows[name] = model(last, **{_compat_core.cache_kwarg(model): cache}, use_cache=True).logits[:, -1]
    assert_logits_close(rows["kvstate restored"], reference_logits, "kvstate")
    assert_logits_close(rows["rope_deltas correct"], reference_logits, "plain with the true delta")
    for wrong in ("rope_deltas None", "rope_deltas 0", "rope_deltas +1"):
        assert (rows[wrong] - reference_logits).abs().max() > 1e-3, wrong
