"""The contract on the real Gemma-3-270M (embedded default model), short prompts.

The first run converts the packaged GGUF once into the user cache (about a minute).
"""

from __future__ import annotations

import pytest
import torch

from kvstate import Session
from kvstate.testing import load_default_model
from tiny import assert_logits_close

pytestmark = pytest.mark.slow
N_NEW = 16


@pytest.fixture(scope="module")
def gemma():
    model, tokenizer = load_default_model(progress=False)
    return model, tokenizer


def encode(tokenizer, text):
    return tokenizer(text, return_tensors="pt").input_ids


def reference(model, ids, n=N_NEW):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences[:, ids.shape[1]:], out.logits[0]


def test_default_model_is_gemma3_with_sliding_layers(gemma):
    model, _ = gemma
    kinds = [layer.kind for layer in Session(model).state.layers]
    assert model.config.model_type == "gemma3_text" and len(kinds) == 18
    assert kinds.count("full_attention") == 3 and kinds.count("sliding_attention") == 15


def test_default_model_loads_as_plain_dequantized_weights(gemma):
    """The converted folder holds float32 tensors, not GGUF blocks: nothing may load it as a quantized model
    (a GGUF quantization_config used to ride along and warn that bf16 matmuls were cast to fp32)."""
    import json

    from kvstate.models.default import default_model_folder

    model, _ = gemma
    config = json.loads((default_model_folder(progress=False) / "config.json").read_text())
    assert "quantization_config" not in config
    assert not getattr(model, "is_quantized", False) and getattr(model, "hf_quantizer", None) is None


def test_split_resume_equals_full_run(gemma):
    model, tok = gemma
    ids = encode(tok, "The three primary colours of light are red, green and")
    ref_tokens, ref_logits = reference(model, ids)
    s = Session(model)
    s.extend(ids[:, :6])
    out = s.generate(ids, max_new_tokens=N_NEW, do_sample=False, return_dict_in_generate=True,
                     output_logits=True)
    assert torch.equal(out.sequences, ref_tokens)
    assert_logits_close(out.logits[0], ref_logits, "first step")


def test_reset_is_bitwise_fresh_and_fork_is_independent(gemma):
    model, tok = gemma
    first = encode(tok, "Write a haiku about the sea.")
    second = encode(tok, "List three prime numbers:")
    s = Session(model)
    s.generate(first, max_new_tokens=4, do_sample=False)
    s.reset()
    after_reset = s.extend(second)
    assert torch.equal(after_reset, Session(model).extend(second))
    fork = s.fork()
    s.extend(encode(tok, " and then")[:, 1:])
    tokens = fork.generate(second, max_new_tokens=N_NEW, do_sample=False)
    assert fork.last_plan.mode == "stored-logits"
    assert torch.equal(tokens, reference(model, second)[0])


def test_truncate_and_divergent_history(gemma):
    model, tok = gemma
    base = encode(tok, "My favourite fruit is the")
    s = Session(model, canonical_chunk=0)  # the longest-prefix planner: a short prompt has no 64-token cut
    s.generate(base, max_new_tokens=N_NEW, do_sample=False)
    other = torch.cat([base, encode(tok, " banana, because")[:, 1:]], 1)
    tokens = s.generate(other, max_new_tokens=N_NEW, do_sample=False)
    assert s.last_plan.mode == "rollback" and s.last_plan.reused == base.shape[1]
    assert torch.equal(tokens, reference(model, other)[0])
