"""Fingerprints cover every weight, and notice in-place edits.

The old fingerprint sampled three tensors: a copy whose first decoder layer was
fine-tuned got the same fingerprint and continued another model's state. Now every
byte of every parameter and buffer is digested (cached per model, re-checked through
version counters).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvstate import PrefixStore, Session
from kvstate.adapters.fingerprinting import fingerprint, legacy_weights_digest
from kvstate.errors import FingerprintMismatchError
from tiny import prompt, tiny_model


def tuned_copy(arch="llama", layer=1):
    """The same model with one decoder layer's MLP nudged, as a fine-tune would."""
    model = tiny_model(arch)
    with torch.no_grad():
        model.get_decoder().layers[layer].mlp.down_proj.weight.mul_(1.01)
    return model


def test_a_copy_differing_in_one_layer_is_refused():
    s = Session(tiny_model("llama"))
    s.extend(prompt(10))
    other = tuned_copy()
    assert legacy_weights_digest(other) == legacy_weights_digest(tiny_model("llama"))  # the old scheme was blind
    with pytest.raises(FingerprintMismatchError, match="weights_digest"):
        Session(other, state=s.state)
    Session(tiny_model("llama"), state=s.state).extend(prompt(2, seed=3))  # same weights, fresh instance: fine


def test_weights_edited_in_place_after_the_session_was_built_are_noticed():
    model = tiny_model("llama")
    s = Session(model)
    s.extend(prompt(10))
    with torch.no_grad():
        model.model.layers[2].self_attn.q_proj.weight.add_(0.01)
    for call in (lambda: s.extend(prompt(2, seed=3)),
                 lambda: s.generate(prompt(12), max_new_tokens=2),
                 lambda: s.compress(__import__("kvstate.compress", fromlist=["KNorm"]).KNorm(0.5))):
        with pytest.raises(FingerprintMismatchError, match="changed after"):
            call()
    s.reset()  # starting over on the new weights is fine
    assert torch.equal(s.extend(prompt(10)), Session(model).extend(prompt(10)))


def test_a_shared_store_never_serves_one_model_to_another(tmp_path):
    store = PrefixStore(tmp_path / "s", chunk_tokens=8)
    ids = prompt(40)
    Session(tiny_model("llama"), store=store).generate(ids, max_new_tokens=2)
    tuned = tuned_copy()
    b = Session(tuned, store=store)
    tokens = b.generate(ids, max_new_tokens=4, do_sample=False)
    assert b.last_plan.reused == 0
    assert torch.equal(tokens, tuned.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                              do_sample=False)[:, 40:])


def test_the_fingerprint_is_cached_and_refreshed_by_version():
    model = tiny_model("qwen3")
    first = fingerprint(model)
    assert fingerprint(model) is first  # cached: nothing changed
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    assert fingerprint(model).weights_digest != first.weights_digest
    model.lm_head.weight.data.mul_(0.5)  # through .data: invisible to version counters
    assert fingerprint(model, refresh=True).weights_digest == first.weights_digest


def test_buffers_and_adapter_weights_count():
    model = tiny_model("llama")
    base = fingerprint(model).weights_digest
    extra = torch.nn.Linear(4, 4, bias=False)  # an adapter attached into the module tree, as peft does
    model.model.layers[0].self_attn.q_proj.add_module("lora_A", extra)
    assert fingerprint(model).weights_digest != base
    with torch.no_grad():
        extra.weight.add_(1)
    assert fingerprint(model).weights_digest != base


def test_a_cast_state_loads_into_the_same_weights_in_another_dtype(tmp_path):
    s = Session(tiny_model("llama"))
    s.extend(prompt(10))
    s.save(tmp_path / "s.kvs")
    wide = tiny_model("llama").to(torch.float64)
    cast = Session.load(tmp_path / "s.kvs", wide, cast_dtype=True)
    assert cast.extend(prompt(2, seed=3)).isfinite().all()
    with pytest.raises(FingerprintMismatchError):
        Session.load(tmp_path / "s.kvs", tuned_copy().to(torch.float64), cast_dtype=True)


def test_fingerprints_of_kvstate_0_1_are_checked_with_their_own_scheme(tmp_path):
    model = tiny_model("llama")
    s = Session(model)
    s.extend(prompt(10))
    old = replace(s.state.fingerprint, weights_digest=legacy_weights_digest(model), weights_sample=None, scheme=1)
    legacy = replace(s.state, fingerprint=old)
    Session(tiny_model("llama"), state=legacy).extend(prompt(2, seed=3))
    with pytest.raises(FingerprintMismatchError):
        Session(tiny_model("llama", seed=1), state=legacy)


def test_a_tokenizers_hash_is_taken_once_and_again_after_tokens_are_added(monkeypatch):
    """Sessions made with one tokenizer share its hash (0.9 s for Gemma 3's vocabulary); adding a token
    changes the tokenizer's length, and the hash is taken again, equal to a fresh tokenizer's."""
    from kvstate.adapters.fingerprinting import tokenizer_hash
    from kvstate.models.tiny_tokenizer import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    first = tokenizer_hash(tokenizer)
    vocab = tokenizer.get_vocab
    monkeypatch.setattr(tokenizer, "get_vocab", lambda: pytest.fail("the kept hash was not used"))
    assert Session(tiny_model("llama"), tokenizer=tokenizer)._fingerprint.tokenizer_hash == first
    monkeypatch.setattr(tokenizer, "get_vocab", vocab)
    tokenizer.add_tokens(["<added>"])
    other = tiny_tokenizer()
    other.add_tokens(["<added>"])
    assert tokenizer_hash(tokenizer) == tokenizer_hash(other) != first
