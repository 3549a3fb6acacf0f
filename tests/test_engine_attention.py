"""The attention path kvstate runs (``kvstate._compat.attention``), checked on the CPU.

* the kernel choice for CUDA, against a rule written apart here (a table, not the module's code);
* the mask forms, classified on the masks transformers (and kvstate's per-layer masks) really build for kvstate's
  forwards (canonical chunks, decode steps, padded batches, sliding windows that cut, compressed states);
* the math kernels the deterministic path runs, against transformers' own sdpa function;
* the path is part of a state's identity: a state fed with eager attention is not resumed by an sdpa model;
* ``kvstate verify`` runs the cold run twice first, and a planted run-dependent noise is diagnosed as kernel
  nondeterminism, never as positions, masks or the token boundary.
"""

from __future__ import annotations

import contextlib
import functools
import json
import warnings

import pytest
import torch

from kvstate import Session
from kvstate._compat import attention
from kvstate._compat.core import attention_backend
from kvstate.cli import main
from kvstate.compress import KNorm
from kvstate.errors import ScheduleWarning
from kvstate.testing.cuda_stand_in import GPU, cuda_stand_in
from tiny import WINDOW, prompt, tiny_model

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


# ----- the kernel choice -----------------------------------------------------------------------------------------
# Written apart from the module: on CUDA, flash (deterministic forward, no dense mask) exactly where the mask is none
# or lower-right causal, the dtype is half precision and the head fits flash; math with the dense mask otherwise;
# transformers' sdpa on the math kernel where the call carries a bias, soft cap, sinks or dropout.
RULE = [
    # dtype, head_dim, mask, extras -> kernel, mask form
    (BF16, 128, "causal", False, "flash", "lower_right"),
    (FP16, 64, "causal", False, "flash", "lower_right"),
    (BF16, 128, "none", False, "flash", "none"),
    (BF16, 256, "causal", False, "flash", "lower_right"),
    (BF16, 288, "causal", False, "math", "dense"),
    (FP32, 128, "causal", False, "math", "dense"),
    (FP32, 128, "none", False, "math", "none"),
    (BF16, 128, "dense", False, "math", "dense"),
    (FP16, 64, "dense", False, "math", "dense"),
    (BF16, 128, "causal", True, "sdpa-math", "causal"),
    (BF16, 128, "dense", True, "sdpa-math", "dense"),
]


@pytest.mark.parametrize(("dtype", "head_dim", "mask", "extras", "kernel", "form"), RULE)
def test_the_cuda_kernel_choice_follows_the_rule(dtype, head_dim, mask, extras, kernel, form):
    assert attention.choose("cuda", dtype, head_dim, mask, extras) == attention.Path(kernel, form)


def test_only_measured_paths_are_trusted_to_repeat():
    # CPU kernels repeat their bits; elsewhere eager does, and sdpa on CUDA through kvstate's kernels; the planted
    # noise stands for the path it wraps (kernels believed to repeat that do not)
    trusted = {("cuda", "sdpa"), ("cuda", "eager"), ("cuda", "kvstate_noisy:sdpa"), ("mps", "eager")}
    for device in ("cpu", "cuda", "mps"):
        for name in ("sdpa", "eager", "flash_attention_2", "flex_attention", "kvstate_noisy:sdpa"):
            expected = device == "cpu" or (device, name) in trusted
            assert attention.trusted(device, name) == expected, (device, name)


# ----- the mask forms on transformers' own masks -------------------------------------------------------------------
@contextlib.contextmanager
def captured(model):
    """Every attention call of ``model`` inside: ``(layer, q, kv, mask)`` (sdpa's masks, sdpa's results)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    calls: list[tuple[int, int, int, torch.Tensor | None]] = []

    def capture(module, query, key, value, mask, **kwargs):
        calls.append((module.layer_idx, query.shape[2], key.shape[2], mask))
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("kvstate_test_capture", capture)
    AttentionMaskInterface.register("kvstate_test_capture", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    with attention_backend(model, "kvstate_test_capture"):
        yield calls


def kinds(calls) -> set[tuple[int, int, int, str]]:
    return {(layer, q, kv, attention.classify(q, kv, mask)) for layer, q, kv, mask in calls}


def test_canonical_chunks_are_causal_and_decode_steps_see_every_key():
    model = tiny_model("llama")
    with captured(model) as calls:
        Session(model, canonical_chunk=8).generate(prompt(20), max_new_tokens=3, do_sample=False)
    layers = range(model.config.num_hidden_layers)
    expected = {(i, q, kv, "causal") for i in layers for q, kv in ((8, 8), (8, 16), (4, 20))}
    expected |= {(i, 1, kv, "none") for i in layers for kv in (21, 22)}  # two decode steps after the prefill
    assert kinds(calls) == expected


def test_padding_needs_the_dense_mask_and_a_compressed_state_does_not():
    model = tiny_model("llama")
    ids = prompt(12, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    with captured(model) as calls:
        Session(model, canonical_chunk=8).extend(ids, mask)
    assert {kind for *_, kind in kinds(calls)} == {"dense"}
    session = Session(model, canonical_chunk=0)
    session.extend(prompt(16))
    session.compress(KNorm(0.5))
    masks = []  # a compressed state's per-layer masks reach each attention module as its attention_mask
    hooks = [layer.self_attn.register_forward_pre_hook(lambda _, args, kwargs: masks.append(kwargs["attention_mask"]),
                                                       with_kwargs=True) for layer in model.model.layers]
    try:
        session.extend(prompt(4, seed=3))
    finally:
        for hook in hooks:
            hook.remove()
    # evicted slots are gone, not masked: every retained slot is visible, so the per-layer mask is causal again
    assert len(masks) == 4 and {attention.classify(4, m.shape[-1], m) for m in masks} == {"causal"}


def test_a_sliding_window_that_cuts_is_dense_and_the_full_layers_stay_causal():
    model = tiny_model("gemma3_text")  # layers 0, 1, 3 slide over WINDOW keys, layer 2 sees everything
    with captured(model) as calls:
        session = Session(model, canonical_chunk=8)
        session.extend(prompt(8))
        session.extend(prompt(8, seed=2))  # keys 0..15: a query sees at most WINDOW of them
    second = {(layer, kind) for layer, q, kv, kind in kinds(calls) if kv > 8}
    assert WINDOW < 16 and second == {(0, "dense"), (1, "dense"), (2, "causal"), (3, "dense")}


def test_an_additive_mask_with_a_bias_is_dense_and_a_plain_one_is_not():
    q, kv = 3, 5
    visible = torch.ones(q, kv, dtype=torch.bool).tril(kv - q)[None, None]
    additive = torch.zeros(1, 1, q, kv).masked_fill(~visible, torch.finfo(torch.float32).min)
    assert attention.classify(q, kv, visible) == attention.classify(q, kv, additive) == "causal"
    assert attention.classify(q, kv, additive + 0.5 * visible) == "dense"  # an ALiBi-like bias on visible keys
    assert attention.classify(q, kv, torch.ones(1, 1, q, kv, dtype=torch.bool)) == "none"
    assert attention.classify(q, q, None) == "causal" and attention.classify(1, kv, None) == "none"


# ----- the math kernels, against transformers' sdpa ----------------------------------------------------------------
@pytest.mark.parametrize("form", ["none", "dense"])
def test_the_math_path_computes_what_transformers_sdpa_computes(form):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, h, n, 16, generator=gen) for h, n in ((8, 5), (2, 9), (2, 9)))
    mask = None
    if form == "dense":
        mask = torch.ones(2, 1, 5, 9, dtype=torch.bool).tril(4)
        mask[1, ..., :2] = False  # padding in the second row
    ours, _ = attention.attend(attention.Path("math", form), module, query, key, value, mask, scaling=0.25)
    if mask is None:  # transformers' meaning of no mask for one query row block ending at the last key
        mask = torch.ones(2, 1, 5, 9, dtype=torch.bool)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.25)
    assert ours.shape == theirs.shape == (2, 5, 8, 16)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


# ----- the path is part of a state's identity ----------------------------------------------------------------------
def test_a_state_fed_with_other_attention_kernels_is_fed_again_not_resumed(tmp_path):
    eager, sdpa = tiny_model("llama", attn="eager"), tiny_model("llama", attn="sdpa")
    history = prompt(30)
    made = Session(eager, canonical_chunk=8)
    made.extend(history[:, :20])
    assert made.state.canonical_device == "cpu@eager"
    made.save(tmp_path / "eager.kvs")
    with pytest.warns(ScheduleWarning, match="fed again"):
        other = Session.load(tmp_path / "eager.kvs", sdpa, canonical_chunk=8)
    options = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)
    warm, cold = other.generate(history, **options), Session(sdpa, canonical_chunk=8).generate(history, **options)
    assert other.last_plan.reused == 0 and "cpu@eager" in other.last_plan.note
    assert torch.equal(torch.cat(warm.logits), torch.cat(cold.logits))
    same = Session.load(tmp_path / "eager.kvs", eager)  # the same kernels: the state's slots are reused
    same.generate(history, max_new_tokens=1, do_sample=False)
    assert same.last_plan.reused == 16 and Session(sdpa).state.canonical_device == ""


def test_on_a_cpu_the_deterministic_path_changes_nothing():
    model = tiny_model("llama")
    with attention.deterministic(model):
        assert model.config._attn_implementation == "sdpa"
    assert attention.label(model) == "" and attention.describe(model) == "sdpa (cpu kernels)"


# ----- verify: the repeat row, and the planted nondeterminism -------------------------------------------------------
@functools.cache
def verify_json(*extra: str) -> tuple[int, dict]:
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["verify", "--model", "tiny:llama", "--quick", "--json", *extra])
    return code, json.loads(out.getvalue())


def test_verify_runs_the_cold_run_twice_first_and_reports_it():
    code, report = verify_json()
    assert code == 0 and report["determinism"]["repeat_bitwise"] is True
    assert report["determinism"]["max_abs"] == 0.0 and "sdpa (cpu kernels)" in report["determinism"]["attention"]
    rows = report["reports"][0]["rows"]
    assert rows[0]["name"] == "kvstate: cold run, repeated" and rows[0]["bitwise"] is True


def test_planted_nondeterministic_attention_is_diagnosed_as_the_kernels_alone():
    code, report = verify_json("--inject", "nondeterministic-attention")
    assert code == 1 and report["ok"] is False
    determinism = report["determinism"]
    assert determinism["repeat_bitwise"] is False and determinism["max_abs"] > 0
    assert "noise planted" in determinism["attention"]
    findings = report["reports"][0]["diagnosis"]
    assert [f["branch"] for f in findings] == ["kernel nondeterminism"]
    assert "not run-to-run deterministic for sdpa with run-dependent noise" in findings[0]["message"]
    assert "attn_implementation" in findings[0]["next_check"]
    assert "say nothing about positions, masks or the token boundary" in findings[0]["message"]


# ----- the CUDA path's plumbing, on the CPU ------------------------------------------------------------------------
@pytest.fixture
def cuda_rules():
    """kvstate's CUDA attention path run on the CPU (``kvstate.testing.cuda_stand_in``): the plumbing and the mask
    semantics, not the CUDA kernels' bits."""
    with cuda_stand_in():
        yield


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text", "lfm2", "qwen3_vl"])
def test_every_forward_runs_through_the_cuda_path_and_answers_as_plain_generate(arch, cuda_rules):
    from kvstate.testing import assert_logits_close

    model = tiny_model(arch)
    ids = prompt(40)  # past gemma3_text's window: its sliding layers need the dense mask
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                           return_dict_in_generate=True, output_logits=True)
    attention.reset_counts()
    session = Session(model, canonical_chunk=16)
    session.extend(ids[:, :30])
    out = session.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert session.state.canonical_device == f"cuda[{GPU}]@det" and model.config._attn_implementation == "sdpa"
    ran = attention.counts()
    assert ran.get("flash", 0) > 0 and (ran.get("math", 0) > 0) == (arch == "gemma3_text"), ran
    assert torch.equal(out.sequences, plain.sequences[:, ids.shape[1]:])
    for ours, theirs in zip(out.logits, plain.logits, strict=True):
        assert_logits_close(ours, theirs)


# ----- warm paths after a cold generate reuse their slots on the CUDA path -------------------------------------------
def test_after_a_cold_generate_every_warm_path_reuses_its_slots_on_the_cuda_path(cuda_rules, tmp_path):
    """The cold run's states are made inside the deterministic path (the model then runs ``kvstate_deterministic``);
    they are labelled as the sdpa model that made them, so the next turn, a fork, a state file, a store hit and a
    truncate each reuse their slots, with the bits of a cold run on the whole history."""
    from kvstate.store import PrefixStore

    model = tiny_model("llama")
    options = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True)
    history = prompt(40)
    store = PrefixStore(tmp_path / "store", chunk_tokens=16)
    session = Session(model, canonical_chunk=16, store=store)
    reply = session.generate(history, max_new_tokens=3, do_sample=False)  # generate first: no extend before it
    assert session.state.canonical_device == f"cuda[{GPU}]@det"
    longer = torch.cat([history, reply, prompt(6, seed=5)], 1)

    def cold(ids):
        return Session(model, canonical_chunk=16).generate(ids, **options)

    def check(name, warm_session, ids, at_least):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ScheduleWarning)  # nothing is silently fed again
            out = warm_session.generate(ids, **options)
        plan = warm_session.last_plan
        ref = cold(ids)
        assert plan.reused >= at_least, (name, plan)
        assert torch.equal(out.sequences, ref.sequences), name
        assert torch.equal(torch.cat(out.logits), torch.cat(ref.logits)), name
        return plan

    fork = session.fork()
    session.save(tmp_path / "turn.kvs")
    loaded = Session.load(tmp_path / "turn.kvs", model)
    cut = session.fork()
    cut.truncate(35)
    assert check("next turn", session, longer, 32).source == "state"
    check("fork", fork, longer, 32)
    check("state file", loaded, longer, 32)
    check("truncate", cut, longer, 32)
    hit = check("store hit", Session(model, canonical_chunk=16, store=store), longer, 32)
    assert hit.source == "store"


def test_a_state_made_on_another_gpu_is_fed_again_with_a_warning_that_says_why(cuda_rules, tmp_path):
    model = tiny_model("llama")
    history = prompt(40)
    made = Session(model, canonical_chunk=16)
    made.extend(history[:, :36])
    made.save(tmp_path / "h100.kvs")
    assert made.state.canonical_device == f"cuda[{GPU}]@det"
    other = "NVIDIA H200|132sm|cuda13.0|torch2.11.0"
    options = dict(max_new_tokens=2, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with cuda_stand_in(other):  # the same file, loaded on another GPU
        with pytest.warns(ScheduleWarning, match="fed again") as caught:
            loaded = Session.load(tmp_path / "h100.kvs", model)
        out = loaded.generate(history, **options)
        ref = Session(model, canonical_chunk=16).generate(history, **options)
    assert GPU in str(caught[0].message) and other in str(caught[0].message)
    assert loaded.last_plan.reused == 0 and GPU in loaded.last_plan.note
    assert loaded.state.canonical_device == f"cuda[{other}]@det"
    assert torch.equal(torch.cat(out.logits), torch.cat(ref.logits))
    assert Session(model).state.canonical_device == ""  # an empty state names no kernels yet


def test_the_device_identity_names_the_gpu_its_multiprocessors_and_versions():
    class Props:
        name, multi_processor_count = "NVIDIA A100-SXM4-40GB MIG 3g.20gb", 42

    attention._cuda_identity.cache_clear()
    original = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda index: Props()
    try:
        found = attention._cuda_identity(0)
    finally:
        torch.cuda.get_device_properties = original
        attention._cuda_identity.cache_clear()
    assert found == f"NVIDIA A100-SXM4-40GB MIG 3g.20gb|42sm|cuda{torch.version.cuda}|torch{torch.__version__}"


# ----- bidirectional attention stays bidirectional --------------------------------------------------------------------
def test_a_call_that_is_not_causal_sees_every_key():
    assert attention.classify(5, 5, None, causal=False) == "none"
    assert attention.classify(5, 9, None, causal=False) == "none"
    assert attention.classify(5, 5, None) == "causal"


def _media(arch):
    """A media prompt for the tiny ``arch``: ``(ids [1, L], model inputs, the vision tower's call)``."""
    from kvstate.testing.tiny import gemma3_image, tiny_video, video_span

    if arch == "gemma3":
        span, pixels = gemma3_image(seed=1)
        ids = torch.cat([prompt(5), span, prompt(4, seed=2)], 1)
        return ids, {"pixel_values": pixels}, lambda m, dtype: m.model.vision_tower(
            pixel_values=pixels.to(dtype)).last_hidden_state
    pixels, grid = tiny_video(seed=1)
    ids = torch.cat([prompt(5), video_span(arch, grid), prompt(4, seed=3)], 1)
    return ids, {"pixel_values_videos": pixels, "video_grid_thw": grid}, lambda m, dtype: m.model.visual(
        pixels.to(dtype), grid_thw=grid).last_hidden_state


@pytest.mark.parametrize("dtype", [FP32, BF16])
@pytest.mark.parametrize("arch", ["qwen3_vl", "gemma3"])
def test_vision_attention_stays_bidirectional_on_the_cuda_path(arch, dtype, cuda_rules):
    """transformers hands the backend's name to the vision config too, so the vision blocks run kvstate's path;
    their calls say ``is_causal=False`` (the call's or the module's) and must see every key, as plain sdpa does."""
    model = tiny_model(arch).to(dtype)
    _, _, tower = _media(arch)
    with torch.no_grad():
        reference = tower(model, dtype)  # plain sdpa: kvstate's path is not entered
        attention.reset_counts()
        with attention.deterministic(model):
            ours = tower(model, dtype)
    assert attention.counts().get("flash", 0) > 0  # the vision calls ran through the path, on the unmasked kernel
    # the same call in the same shape: bitwise in float32; in bfloat16 the stand-in runs the same kernel too, so the
    # difference must stay within one bfloat16 rounding of the features' scale (causal attention was 6% of it)
    if dtype == FP32:
        assert torch.equal(ours, reference)
    else:
        bound = reference.abs().max().item() * 2 ** -8
        assert (ours.float() - reference.float()).abs().max().item() <= bound


@pytest.mark.parametrize("arch", ["qwen3_vl", "gemma3"])
def test_a_media_prompt_answers_as_plain_generate_on_the_cuda_path(arch, cuda_rules):
    from kvstate.testing import assert_logits_close

    model = tiny_model(arch)
    ids, inputs, _ = _media(arch)
    if arch == "gemma3":  # the processor's token types: the image block attends both ways
        kinds = {"token_type_ids": (ids == model.config.image_token_id).long()}
    else:
        config = model.config
        kinds = {"mm_token_type_ids": (ids == config.image_token_id).int() + 2 * (ids == config.video_token_id).int()}
    options = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), **kinds, **inputs, **options)
    attention.reset_counts()
    out = Session(model, canonical_chunk=8).generate(ids, **inputs, **options)
    assert attention.counts().get("flash", 0) > 0
    assert torch.equal(out.sequences, plain.sequences[:, ids.shape[1]:])
    for ours, theirs in zip(out.logits, plain.logits, strict=True):
        assert_logits_close(ours, theirs)
