"""The CI subset of the coverage sweep of causal-LM types (the full sweep is ``scripts/coverage.py``).

One type per cache-layer class, head layout (MHA, GQA, MQA, MLA, per-layer shapes), sliding
window, hybrid, recurrent and looped pattern, each built tiny by the shrinker and proved by
``verify(quick=True)`` against plain transformers; and one per reason kvstate refuses a model,
checked for the typed refusal and its reason. The table's second column is measured: the
forwards a continuation takes, counted by a hook on the model (stepwise families take one per
token, the rest one per chunk).
"""

from __future__ import annotations

import pytest
import torch

from kvstate import Session
from kvstate.errors import UnsupportedModelError
from kvstate.selfcheck import adapter_for
from kvstate.testing.shrink import tiny_causal_lm
from kvstate.verify import verify
from tiny import count_forwards

# type: (what it stands for, whether it continues one token per forward)
ACCEPTED = {
    "gpt2": ("MHA, DynamicLayer", False),
    "smollm3": ("GQA", False),
    "falcon": ("MQA", False),
    "gpt_bigcode": ("MQA, fused KV", False),
    "deepseek_v3": ("MLA: K and V of different widths", False),
    "minicpm3": ("MLA", False),
    "gemma4_text": ("per-layer head shapes, DynamicSlidingWindowLayer", False),
    "gemma3n_text": ("DummyLayer (KV sharing), per-layer", False),
    "starcoder2": ("sliding window", False),
    "cohere2": ("sliding + full layers", False),
    "gpt_oss": ("sliding, attention sinks, MoE", False),
    "mixtral": ("MoE", False),
    "olmoe": ("MoE", False),
    "phi3": ("fused QKV", False),
    "gemma3": ("multimodal wrapper, text path", False),
    "zamba2": ("LinearAttentionAndFullAttentionLayer (hybrid)", False),
    "inkling_text": ("LinearAttentionAndSlidingWindowAttentionLayer", False),
    "bamba": ("LinearAttentionLayer + DynamicLayer (mamba2 hybrid)", False),
    "nemotron_h": ("DummyLayer + LinearAttentionLayer", False),
    "qwen3_5_text": ("gated delta net + attention", False),
    "falcon_mamba": ("recurrent, structural: chunks through the scan continued from the cache", False),
    "dory": ("looped: extra cache layers per pass", False),
    "mllama": ("cross-attention layers empty on the text path", False),
    "bert-generation": ("encoder family as a causal decoder", False),
    "whisper": ("decoder of an encoder-decoder", False),
    "minimax": ("MiniMaxCache (registered)", False),
    "xlstm": ("xLSTMCache (registered)", False),
    "rwkv": ("a `state` list instead of a transformers cache (registered)", False),
    "mamba": ("selective scan continued from the cached state (registered)", False),
    "recurrent_gemma": ("RG-LRU, registered: transformers drops its state on multi-token chunks", True),
    "olmo2": ("MHA with QK-norm", False),
}

# type: a phrase the refusal must contain
REFUSED = {
    "deepseek_v32": "dynamic sparse attention",  # DynamicIndexedLayer
    "openai-gpt": "does not take a transformers cache",
    "deepseek_v4": "DeepseekV4HCACache",
    "cpmant": "failed kvstate's self-check",  # bidirectional prompt tokens
    "doge": "does not reproduce a whole forward",
    "musicgen": "has its own generate()",  # its delay pattern rewrites the prompt
}


@pytest.mark.parametrize("model_type", sorted(ACCEPTED))
def test_accepted_type_passes_verify(model_type):
    model = tiny_causal_lm(model_type)
    ids = torch.randint(20, 120, (1, 25), generator=torch.Generator().manual_seed(0))
    report = verify(model, ids[:, :20], new_tokens=4, fresh=lambda: tiny_causal_lm(model_type), quick=True)
    assert report.ok, report.table()
    session = Session(model)
    session.extend(ids[:, :20])
    with count_forwards(model) as forwards:
        session.extend(ids[:, 20:])  # 5 tokens continuing a cached state
    expected = 5 if ACCEPTED[model_type][1] else 1
    assert forwards[0] == expected, f"{model_type}: {forwards[0]} forwards for 5 tokens, expected {expected}"
    assert adapter_for(model).caps.stepwise == ACCEPTED[model_type][1]


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_type_names_its_reason(model_type):
    model = tiny_causal_lm(model_type)
    with pytest.raises(UnsupportedModelError, match=REFUSED[model_type]):
        adapter_for(model)

