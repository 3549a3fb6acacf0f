"""Unregistered causal decoders through the structural adapter and its self-check.

Each accepted architecture must hold kvstate's contract against plain transformers
(split resume, rollback, fork, save + load into a fresh instance, reset); refused ones
must say why. The planted architecture keeps state outside the cache in a way no
structure reveals; the self-check must refuse it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvstate import Session
from kvstate.errors import RollbackError, UnsupportedModelError
from kvstate.selfcheck import adapter_for, cached_verdict
from tiny import assert_logits_close, count_forwards, prompt

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {  # one per head layout and cache pattern the structural path must handle
    "gpt2": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2),
    "phi3": dict(SMALL, num_key_value_heads=2),  # GQA
    "gpt_bigcode": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=512, multi_query=True,
                        bos_token_id=1, eos_token_id=2),  # MQA
    "falcon": dict(SMALL, num_kv_heads=1, multi_query=True, new_decoder_architecture=False),  # MQA, alibi-free
    "deepseek_v3": dict(SMALL, num_key_value_heads=4, moe_intermediate_size=32, n_shared_experts=1,
                        n_routed_experts=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16,
                        qk_nope_head_dim=8, n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
                        head_dim=8),  # MLA: K and V of different widths
    "starcoder2": dict(SMALL, num_key_value_heads=2, sliding_window=8),  # sliding window
    "falcon_mamba": dict(vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                         conv_kernel=4, time_step_rank=8, bos_token_id=1, eos_token_id=2, pad_token_id=0),
}


def build(model_type: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **CONFIGS[model_type])).eval()
    model.generation_config.eos_token_id = None
    return model


def plain(model, ids, n=6):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)[:, ids.shape[1]:]


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_structural_models_hold_the_contract(model_type, tmp_path):
    model = build(model_type)
    caps = adapter_for(model).caps
    assert caps.name == f"structural:{model_type}"
    assert not caps.stepwise  # falcon_mamba: chunks, its scan continued from the cached state
    ids = prompt(30)
    s = Session(model)
    s.extend(ids[:, :20])
    assert torch.equal(s.generate(ids, max_new_tokens=6, do_sample=False), plain(model, ids))
    fork = s.fork()
    s.save(tmp_path / "s.kvs")
    other = torch.cat([ids[:, :24], prompt(4, seed=3)], 1)  # rolls back (or resumes from a checkpoint)
    assert torch.equal(s.generate(other, max_new_tokens=6, do_sample=False), plain(model, other))
    loaded = Session.load(tmp_path / "s.kvs", build(model_type))  # a fresh instance, same weights
    longer = torch.cat([ids, plain(model, ids), prompt(3, seed=4)], 1)
    assert torch.equal(loaded.generate(longer, max_new_tokens=4, do_sample=False), plain(model, longer, 4))
    assert torch.equal(fork.generate(longer, max_new_tokens=4, do_sample=False), plain(model, longer, 4))
    s.reset()
    assert_logits_close(s.extend(ids[:, :9]), Session(model).extend(ids[:, :9]))


def test_falcon_mamba_rolls_back_through_checkpoints_only():
    model = build("falcon_mamba")
    s = Session(model)
    s.extend(prompt(12))
    s.extend(prompt(6, seed=2))
    with pytest.raises(RollbackError):
        s.truncate(15)
    s.truncate(12)
    assert_logits_close(s.extend(prompt(3, seed=5)),
                        Session(model).extend(torch.cat([prompt(12), prompt(3, seed=5)], 1)))


def planted_model():
    """A llama whose position ids come from a counter on the module, i.e. state outside the cache.

    Nothing in its structure says so: the config, the cache layers and the signature are
    plain llama's. (The model type is renamed so that the llama registration does not apply.)
    """
    config = AutoConfig.for_model("llama", **SMALL, num_key_value_heads=2, head_dim=16)
    config.model_type = "planted_llama"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    decoder = model.model
    decoder.seen = 0

    def absolute_positions(module, args, kwargs):
        q = kwargs["inputs_embeds"].shape[1] if kwargs.get("input_ids") is None else kwargs["input_ids"].shape[1]
        kwargs["position_ids"] = torch.arange(module.seen, module.seen + q)[None]
        module.seen += q
        return args, kwargs

    decoder.register_forward_pre_hook(absolute_positions, with_kwargs=True)
    return model


def test_a_planted_architecture_is_refused():
    with pytest.raises(UnsupportedModelError, match="self-check") as info:
        Session(planted_model())
    assert "outside the cache" in str(info.value)


def test_the_verdict_is_cached_per_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTATE_SELFCHECK_CACHE", str(tmp_path))
    model = build("gpt2")
    with count_forwards(model) as first:
        adapter_for(model)
    assert len(list(tmp_path.glob("*.json"))) == 1
    fresh = build("gpt2")  # another instance with the same weights: no probe
    with count_forwards(fresh) as again:
        adapter_for(fresh)
    assert first[0] > 5 and again[0] == 2  # one forward for the cache layout, one for the K/V widths
    other = build("gpt2", seed=1)  # other weights: a verdict of its own
    with count_forwards(other) as probed:
        adapter_for(other)
    assert probed[0] > 5 and len(list(tmp_path.glob("*.json"))) == 2
    verdict = cached_verdict(model, adapter_for(model))
    assert verdict.mode == "exact" and verdict.rollback and verdict.reason is None
    monkeypatch.setenv("KVSTATE_SELFCHECK_CACHE", "off")
    with count_forwards(model) as uncached:
        adapter_for(model)
    assert uncached[0] > 5


def one_token_continuations_model():
    """A llama that, like prophetnet, refuses a multi-token chunk on a filled cache."""
    config = AutoConfig.for_model("llama", **SMALL, num_key_value_heads=2, head_dim=16)
    config.model_type = "one_token_llama"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()

    def refuse_chunks(module, args, kwargs):
        cache, ids = kwargs.get("cache"), kwargs.get("input_ids")
        if cache is not None and cache.get_seq_length() > 0 and ids is not None and ids.shape[1] > 1:
            raise AssertionError("use_cache is only supported for input_ids of length 1")
        return args, kwargs

    model.register_forward_pre_hook(refuse_chunks, with_kwargs=True)
    return model


def test_a_model_that_crashes_on_chunks_continues_one_token_per_forward(monkeypatch):
    monkeypatch.setenv("KVSTATE_SELFCHECK_CACHE", "off")
    model = one_token_continuations_model()
    assert adapter_for(model).caps.stepwise
    ids = prompt(20)
    s = Session(model)
    s.extend(ids[:, :8])
    s.extend(ids[:, 8:])  # one token per forward: no crash
    assert torch.equal(s.generate(ids, max_new_tokens=4, do_sample=False), plain(model, ids, 4))


def test_a_model_without_position_ids_refuses_padded_batches():
    from kvstate.errors import KVStateError
    from kvstate.testing.shrink import tiny_causal_lm

    model = tiny_causal_lm("whisper")  # its decoder counts positions from the cache length
    caps = adapter_for(model).caps
    assert not caps.position_ids and not caps.padding
    ids = torch.cat([prompt(6), prompt(6, seed=2)])
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :2] = False
    with pytest.raises(KVStateError, match="padd"):
        Session(model).extend(ids, mask)


def test_rwkv_rescales_its_weights_before_the_fingerprint(tmp_path):
    """RWKV divides block weights on its first inference forward; kvstate does it when it meets the
    model, so a state made before and after that forward has one fingerprint."""
    from tiny import tiny_model

    model = tiny_model("rwkv")
    before = model.rwkv.blocks[2].attention.output.weight.clone()
    s = Session(model)
    assert torch.equal(model.rwkv.blocks[2].attention.output.weight, before / 2)  # rescale_every=2
    ids = prompt(16)
    s.extend(ids[:, :10])
    s.extend(ids[:, 10:])  # the same weights: no fingerprint error
    s.save(tmp_path / "r.kvs")
    fresh = tiny_model("rwkv")  # not rescaled yet
    longer = torch.cat([ids, prompt(3, seed=7)], 1)
    got = Session.load(tmp_path / "r.kvs", fresh).generate(longer, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, plain(fresh, longer, 4))


def test_falcon_mamba_continues_in_chunks_only_through_the_scan(monkeypatch):
    """transformers starts FalconMamba's scan from zeros on a chunk; the probe finds that plain chunks
    drift, that chunks with the scan continued from the cache are exact, and picks those."""
    from kvstate.selfcheck import probe, structural_adapter
    from tiny import count_forwards

    monkeypatch.setenv("KVSTATE_SELFCHECK_CACHE", "off")
    model = build("falcon_mamba")
    assert probe(model, structural_adapter(model)).mode == "exact-scan"
    ids = prompt(30)
    s = Session(model)
    s.extend(ids[:, :11])
    with count_forwards(model) as forwards:
        logits = s.extend(ids[:, 11:])
    assert forwards[0] == 1
    assert_logits_close(logits, Session(model).extend(ids))
