"""Tiny random transformers models built from configs: no downloads, real classes."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

WINDOW = 12  # sliding window small enough that tests cross it

_COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=512, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)

CONFIGS: dict[str, dict] = {
    "llama": {},
    "qwen3": {},
    "qwen2": {},
    "mistral": {"sliding_window": None},
    "gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 8},
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 8,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                    "sliding_attention"]},
}
SLIDING = ("gemma2", "gemma3_text")


def tiny_config(model_type: str, attn: str = "sdpa"):
    config = AutoConfig.for_model(model_type, **{**_COMMON, **CONFIGS[model_type]})
    config._attn_implementation = attn
    return config


def tiny_model(model_type: str, seed: int = 0, attn: str = "sdpa"):
    """A fresh instance; the same seed gives the same weights."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, attn), dtype=torch.float32)
    return model.eval()
