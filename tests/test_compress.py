"""KV compression: identity at ratio 0, exactness against a hand-made masked reference.

The reference is independent of kvstate's mask code: a plain forward over the whole
sequence in which each decoder layer gets an explicit mask (built here) that lets
the continuation's queries see only the retained slots, at their original positions.
"""

from __future__ import annotations

import pytest
import torch

import children
from kvstate import Session
from kvstate.compress import (
    TOVA,
    ExpectedAttention,
    KNorm,
    KVzip,
    PerLayerBudget,
    Random,
    ReRotate,
    SnapKV,
    StreamingLLM,
)
from kvstate.testing.tiny import IMAGE_TOKEN, image_span, tiny_image
from tiny import WINDOW, assert_logits_close, prompt, tiny_model

POLICIES = {
    "streaming": lambda r: StreamingLLM(r, sinks=2),
    "snapkv": lambda r: SnapKV(r, window=4, kernel=3),
    "tova": lambda r: TOVA(r),
    "knorm": lambda r: KNorm(r),
    "random": lambda r: Random(r, seed=3),
    "pyramid": lambda r: PerLayerBudget(r, policy=KNorm()),
    "kvzip": lambda r: KVzip(r, prompt=(5, 6, 7), chunk=16),  # two reconstruction chunks
    "expected": lambda r: ExpectedAttention(r, window=4, future=16),
    "pyramid_kvzip": lambda r: PerLayerBudget(r, policy=KVzip(chunk=16)),
}
RECURRENT_OK = ("lfm2", "qwen3_next", "jamba", "falcon_h1", "mamba", "mamba2", "recurrent_gemma")


def test_ratio_zero_is_bitwise_identity():
    """Ratio 0 returns the very same state for every policy, so continuing is the uncompressed path.

    The identity is one early return in ``compress_state``; checking it once per policy,
    on a sliding-window model, plus a budget of all-zero per-layer ratios, covers it.
    """
    model = tiny_model("gemma3_text")
    ids, more = prompt(30), prompt(4, seed=7)
    s = Session(model)
    s.extend(ids)
    before = s.state
    for name, make in POLICIES.items():
        s.compress(make(0.0))
        assert s.state is before, name
    s.compress(PerLayerBudget(0.3, policy=KNorm(), ratios=(0.0,) * len(before.layers)))
    assert s.state is before
    plain = Session(model)
    plain.extend(ids)
    assert torch.equal(s.extend(more), plain.extend(more))


def retained_tokens(state, layer, head=0):
    """Token indices of one KV head's retained slots in a layer (positions are unique per token here)."""
    track = state.positions[0]
    kept = state.layers[layer]
    slots = kept.positions[0, head] if getattr(kept, "per_head", False) else kept.positions[0]
    if track.dim() == 1:
        return [p for p in slots.tolist() if p >= 0]
    return [int((track == p).all(-1).nonzero()[0]) for p in slots if p[0] >= 0]


def masked_reference(model, ids, state, T, **inputs):
    """Last-position logits of a full forward whose continuation queries see only retained slots, per KV head
    (each query head reads its group's KV head, as ``repeat_kv`` pairs them)."""
    backend = model.config.get_text_config(decoder=True)._attn_implementation
    q_heads = model.config.get_text_config(decoder=True).num_attention_heads
    layers = model.get_decoder().layers
    L = ids.shape[1]

    def hook_for(i):
        layer = state.layers[i]
        H = layer.keys.shape[1] if getattr(layer, "keys", None) is not None else 1
        allowed = torch.ones(H, L, L, dtype=torch.bool).tril()
        if layer.keys is not None and getattr(layer, "compressed", False):
            for h in range(H):
                evicted = sorted(set(range(T)) - set(retained_tokens(state, i, h)))
                allowed[h, T:, evicted] = False
        if getattr(layer, "window", None):
            idx = torch.arange(L)
            allowed &= (idx[:, None] - idx[None, :]) < layer.window
        mask = allowed.repeat_interleave(q_heads // H, dim=0)[None]

        def hook(_module, args, kwargs):
            dtype = kwargs["hidden_states"].dtype if "hidden_states" in kwargs else args[0].dtype
            kwargs["attention_mask"] = mask if backend == "sdpa" else \
                torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
            return args, kwargs

        return hook

    handles = [layers[i].register_forward_pre_hook(hook_for(i), with_kwargs=True)
               for i in range(len(layers)) if state.layers[i].kind != "recurrent"]
    try:
        with torch.no_grad():
            return model(ids, **inputs).logits[:, -1]
    finally:
        for h in handles:
            h.remove()


def check_against_reference(arch, policy, attn=None, steps=3):
    model = tiny_model(arch, attn=attn)
    T = 3 * WINDOW
    ids = prompt(T)
    s = Session(model)
    s.extend(ids)
    s.compress(policy)
    compressed = s.state
    assert any(getattr(layer, "compressed", False) for layer in compressed.layers)
    seq = torch.cat([ids, prompt(5, seed=4)], 1)
    logits = s.extend(seq[:, T:])
    for step in range(steps):  # continuation chunk, then decode steps, each against the reference
        assert_logits_close(logits, masked_reference(model, seq, compressed, T), f"{arch} step {step}")
        token = logits.argmax(-1, keepdim=True)
        seq = torch.cat([seq, token], 1)
        logits = s.extend(token)
    return s


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_policy_continuation_matches_masked_reference(arch, name):
    check_against_reference(arch, POLICIES[name](0.5))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_per_layer_budgets_are_exact_on_both_backends(arch, attn):
    s = check_against_reference(arch, PerLayerBudget(0.5, policy=KNorm(), ratios=(0.2, 0.7, 0.5, 0.4)), attn=attn)
    assert len({layer.slots for layer in s.state.layers}) > 1  # lengths really differ per layer


def test_generate_after_compression_matches_reference():
    model = tiny_model("llama")
    ids = prompt(30)
    s = Session(model)
    s.extend(ids)
    s.compress(SnapKV(0.6, window=4, kernel=3))
    compressed = s.state
    history = torch.cat([ids, prompt(4, seed=5)], 1)
    tokens = s.generate(history, max_new_tokens=5, do_sample=False)
    seq = history
    for _ in range(5):
        seq = torch.cat([seq, masked_reference(model, seq, compressed, 30).argmax(-1, keepdim=True)], 1)
    assert torch.equal(tokens, seq[:, history.shape[1]:])
    assert s.state.next_position.item() == history.shape[1] + 4  # true logical positions, not slot counts


@pytest.mark.parametrize("arch", RECURRENT_OK[:3])
def test_hybrids_compress_attention_layers_only(arch):
    s = Session(tiny_model(arch))
    s.extend(prompt(24))
    before = s.state.layers
    s.compress(KNorm(0.5))
    for old, new in zip(before, s.state.layers, strict=True):
        if old.kind == "recurrent":
            assert new is old
    check_against_reference(arch, KNorm(0.5))


def test_qwen3_vl_image_prefix_keeps_multimodal_positions():
    model = tiny_model("qwen3_vl")
    pixels, grid, n = tiny_image((4, 6))
    ids = torch.cat([prompt(6), image_span(n), prompt(12, seed=2)], 1)
    T = ids.shape[1]
    s = Session(model)
    s.extend(ids, pixel_values=pixels, image_grid_thw=grid)
    s.compress(SnapKV(0.5, window=4, kernel=3))
    compressed = s.state
    assert compressed.layers[0].positions.dim() == 3
    seq = torch.cat([ids, prompt(4, seed=9)], 1)
    logits = s.extend(seq[:, T:])
    inputs = {"pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": (seq == IMAGE_TOKEN).int()}
    assert_logits_close(logits, masked_reference(model, seq, compressed, T, **inputs), "qwen3-vl")


CHILD = r"""
import sys, torch
from safetensors.torch import save_file
from kvstate import Session
from kvstate.testing.tiny import tiny_model, tiny_prompt
s = Session.load(sys.argv[1], tiny_model("gemma3_text"))
save_file({"logits": s.extend(tiny_prompt(5, seed=4)).contiguous()}, sys.argv[2])
"""


def test_compressed_state_resumes_in_another_process(tmp_path):
    from safetensors.torch import load_file

    s = Session(tiny_model("gemma3_text"))
    s.extend(prompt(3 * WINDOW))
    s.compress(PerLayerBudget(0.5, policy=SnapKV(window=4, kernel=3)))
    s.save(tmp_path / "c.kvs")
    expected = s.fork().extend(prompt(5, seed=4))
    children.run(CHILD, str(tmp_path / "c.kvs"), str(tmp_path / "out.safetensors"))  # another process
    assert torch.equal(load_file(str(tmp_path / "out.safetensors"))["logits"], expected)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}])
def test_rerotate_matches_keys_recomputed_at_new_positions(scaling):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_model("llama") if not scaling else _scaled_llama(scaling)
    if scaling:  # the scaled model really rotates differently
        assert not torch.allclose(model.model.rotary_emb.inv_freq, tiny_model("llama").model.rotary_emb.inv_freq)
    raw = {}
    hooks = [getattr(layer.self_attn, proj).register_forward_hook(
                 lambda m, a, out, key=(proj, i): raw.__setitem__(key, out))
             for i, layer in enumerate(model.model.layers) for proj in ("k_proj", "v_proj")]
    ids = prompt(20)
    s = Session(model)
    s.extend(ids)
    for h in hooks:
        h.remove()
    s.compress(ReRotate(policy=StreamingLLM(0.5, sinks=2)))
    kept = [0, 1, *range(12, 20)]  # sinks + recent
    new_positions = torch.arange(len(kept))[None]
    cos, sin = model.model.rotary_emb(raw["k_proj", 0], new_positions)
    cache = []
    for i, layer in enumerate(s.state.layers):
        k, v = (raw[proj, i][:, kept].view(1, len(kept), -1, 8).transpose(1, 2) for proj in ("k_proj", "v_proj"))
        _, expected = apply_rotary_pos_emb(k, k, cos, sin)
        delta = (layer.keys - expected).abs().max().item()
        assert delta <= 1e-5 * expected.abs().max().item(), f"layer {i}: {delta}"
        assert layer.positions[0].tolist() == list(range(len(kept)))
        cache.append((expected, v))
    assert s.state.next_position.item() == len(kept)
    more = prompt(2, seed=3)
    assert_logits_close(s.extend(more), _plain_continuation(model, cache, more, len(kept)), "rerotated")


def _plain_continuation(model, cache, ids, start):
    """Plain transformers continuing ``ids`` at ``start`` from K/V the test built: ``cache`` is per layer
    ``(keys, values)`` ``[B, H, S, D]``."""
    import inspect

    from transformers import DynamicCache

    past = DynamicCache(config=model.config)
    for i, (keys, values) in enumerate(cache):
        past.update(keys, values, i)
    positions = torch.arange(start, start + ids.shape[1])[None]
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.24 renamed it
    with torch.no_grad():
        return model(ids, position_ids=positions, use_cache=True, **{name: past}).logits[:, -1]


def test_rerotate_by_a_uniform_shift_matches_the_masked_reference():
    # RoPE scores depend on distances only: with no sinks every kept slot moves by the same amount,
    # so continuing the re-rotated state equals the masked forward at the original positions
    model = tiny_model("llama")
    T = 3 * WINDOW
    ids, more = prompt(T), prompt(3, seed=6)
    s = Session(model)
    s.extend(ids)
    unrotated = s.fork()
    unrotated.compress(StreamingLLM(0.5, sinks=0))
    s.compress(ReRotate(policy=StreamingLLM(0.5, sinks=0)))
    assert s.state.next_position.item() == T - T // 2  # really moved
    reference = masked_reference(model, torch.cat([ids, more], 1), unrotated.state, T)
    assert_logits_close(s.extend(more), reference, "uniform shift")


def _scaled_llama(scaling):
    from transformers import AutoModelForCausalLM

    from kvstate.testing.tiny import tiny_config

    config = tiny_config("llama")
    config.rope_parameters = scaling
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_decoding_under_a_budget_keeps_slots_bounded_and_positions_true():
    from kvstate.compress import decode_with_budget

    model = tiny_model("llama")
    ids = prompt(30)
    s = Session(model)
    tokens = decode_with_budget(s, ids, KNorm(), budget=20, every=4, max_new_tokens=12)
    assert tokens.shape == (1, 12)
    assert all(layer.slots <= 20 for layer in s.state.layers)  # compressed to 16 every 4 tokens
    assert s.state.next_position.item() == 30 + 11  # the last token is not fed yet
    assert s.state.positions[0, -1].item() == 40  # true logical position, not the slot count
    roomy = Session(model)
    same = decode_with_budget(roomy, ids, KNorm(), budget=1000, every=4, max_new_tokens=12)
    plain = Session(model).generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(same, plain)  # a budget that never binds changes nothing


def test_attention_policies_refuse_missing_attention():
    from kvstate.compress import ScoreInput
    from kvstate.errors import InputError

    x = ScoreInput(layer=0, n_layers=1, keys=torch.randn(1, 2, 6, 8), positions=torch.arange(6)[None])
    for policy in (TOVA(0.5), SnapKV(0.5, window=2, kernel=3)):
        with pytest.raises(InputError, match="attention weights"):
            policy.scores(x)


@pytest.mark.parametrize("keep", [True, False])
def test_media_spans_keep_or_drop_whole_images_and_the_file_records_it(keep, tmp_path):
    """A policy can keep or drop an image whole; the continuation stays exact ("attention
    restricted to the retained slots") and ``state.media`` records whether the image survived."""
    from kvstate.compress import MediaSpans

    model = tiny_model("qwen3_vl")
    pixels, grid, n = tiny_image((4, 6))
    ids = torch.cat([prompt(6), image_span(n), prompt(12, seed=2)], 1)
    T = ids.shape[1]
    s = Session(model)
    s.extend(ids, pixel_values=pixels, image_grid_thw=grid)
    (item,) = s.state.media
    s.compress(MediaSpans(policy=KNorm(0.5), keep=keep))
    compressed = s.state
    image = set(range(item.start, item.end))
    for i in range(len(compressed.layers)):
        retained = set(retained_tokens(compressed, i))
        assert image <= retained if keep else not image & retained
        assert len(retained) == (max(T - T // 2, n) if keep else min(T - T // 2, T - n))
    assert compressed.media[0].kept is keep
    s.save(tmp_path / "c.kvs")
    assert Session.load(tmp_path / "c.kvs", tiny_model("qwen3_vl")).state.media == compressed.media
    seq = torch.cat([ids, prompt(4, seed=9)], 1)
    logits = s.extend(seq[:, T:])
    inputs = {"pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": (seq == IMAGE_TOKEN).int()}
    assert_logits_close(logits, masked_reference(model, seq, compressed, T, **inputs), f"keep={keep}")


def test_media_spans_refuse_layers_compressed_before():
    from kvstate.compress import MediaSpans
    from kvstate.errors import InputError

    model = tiny_model("qwen3_vl")
    pixels, grid, n = tiny_image((4, 6))
    s = Session(model)
    s.extend(torch.cat([prompt(6), image_span(n), prompt(12, seed=2)], 1), pixel_values=pixels, image_grid_thw=grid)
    s.compress(KNorm(0.25))
    before = s.state
    with pytest.raises(InputError, match="needs to know which slots hold media"):
        s.compress(MediaSpans(policy=KNorm(0.25)))
    assert s.state is before
    with pytest.raises(InputError, match="by keyword"):
        MediaSpans(KNorm(0.25))  # the inner policy given where the ratio goes
