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


def tiny_config(model_type: str, attn: str | None = None):
    attn = attn or ("eager" if model_type == "gemma2" else "sdpa")  # gemma2 has no sdpa path
    config = AutoConfig.for_model(model_type, **{**_COMMON, **CONFIGS[model_type]})
    config._attn_implementation = attn
    return config


def tiny_model(model_type: str, seed: int = 0, attn: str | None = None):
    """A fresh instance; the same seed gives the same weights."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, attn), dtype=torch.float32)
    # No EOS: every greedy run makes exactly max_new_tokens, so rows stay comparable.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def prompt(length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    """Random token ids ``[batch, length]`` avoiding the special ids 0..2."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=gen)


def assert_logits_close(actual: torch.Tensor, reference: torch.Tensor, what: str = "logits") -> None:
    """The project tolerance: max |Δ| <= 1e-5 x max |reference| (fp32)."""
    delta = (actual.float() - reference.float()).abs().max().item()
    bound = 1e-5 * reference.float().abs().max().item()
    assert delta <= bound, f"{what}: max |Δ| = {delta:.3e} > {bound:.3e}"
