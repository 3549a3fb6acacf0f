"""Tiny random-weight models of each supported family, built from configs (no downloads).

Used by the test suite and by ``kvstate verify --model tiny:<model_type>``. The same
seed always gives the same weights, so a "fresh instance" is easy to build.
"""

from __future__ import annotations

from typing import Any

import torch

WINDOW = 12  # sliding window small enough that short prompts cross it

_COMMON: dict[str, Any] = dict(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)

CONFIGS: dict[str, dict[str, Any]] = {
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
_EAGER_ONLY = ("gemma2",)  # transformers has no sdpa path for these


def tiny_config(model_type: str, attn: str | None = None) -> Any:
    """The tiny config of ``model_type`` with attention backend ``attn`` (default sdpa)."""
    from transformers import AutoConfig

    from .errors import UnsupportedModelError

    if model_type not in CONFIGS:
        raise UnsupportedModelError(f"no tiny config for {model_type!r}", expected=sorted(CONFIGS),
                                    found=model_type, fix="pick one of the listed model types")
    config = AutoConfig.for_model(model_type, **{**_COMMON, **CONFIGS[model_type]})
    config._attn_implementation = attn or ("eager" if model_type in _EAGER_ONLY else "sdpa")
    return config


def tiny_model(model_type: str, seed: int = 0, attn: str | None = None) -> Any:
    """A fresh fp32 instance in eval mode; the same seed gives the same weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, attn), dtype=torch.float32)
    # No EOS: every greedy run makes exactly max_new_tokens, so rows stay comparable.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def tiny_prompt(length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    """Random token ids ``[batch, length]`` avoiding the special ids 0..2."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, _COMMON["vocab_size"], (batch, length), generator=gen)
