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
_SPECIAL = dict(vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2)
# Recurrent and hybrid families: every kind of layer each architecture has appears at least once.
CONFIGS.update({
    "mamba": dict(_SPECIAL, hidden_size=32, state_size=8, num_hidden_layers=2, conv_kernel=4, expand=2),
    "mamba2": dict(_SPECIAL, hidden_size=32, num_heads=8, head_dim=8, state_size=8, n_groups=2,
                   num_hidden_layers=2, conv_kernel=4, expand=2, chunk_size=8),
    "lfm2": dict(_SPECIAL, **_ATTN, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                 layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, block_auto_adjust_ff_dim=False),
    "qwen3_next": dict(_SPECIAL, **_ATTN, hidden_size=32, intermediate_size=64, num_hidden_layers=3, head_dim=8,
                       layer_types=["linear_attention", "full_attention", "linear_attention"],
                       linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
                       linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "jamba": dict(_SPECIAL, **_ATTN, hidden_size=32, intermediate_size=64, num_hidden_layers=4, attn_layer_period=2,
                  attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                  mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False),
    "falcon_h1": dict(_SPECIAL, **_ATTN, hidden_size=32, intermediate_size=64, num_hidden_layers=2, mamba_d_ssm=64,
                      mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4,
                      mamba_expand=2, mamba_chunk_size=8),
    "recurrent_gemma": dict(_SPECIAL, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=1, lru_width=32, attention_window_size=8,
                            conv1d_width=4, block_types=["recurrent", "recurrent", "attention"]),
    # a linear layer first: MiniMax's own cache then miscounts the past unless kvstate builds it (_compat)
    "minimax": dict(_SPECIAL, **_ATTN, hidden_size=32, intermediate_size=64, num_hidden_layers=3, head_dim=8,
                    num_local_experts=2, layer_types=["linear_attention", "full_attention", "linear_attention"],
                    block_size=8),
    "xlstm": dict(_SPECIAL, hidden_size=128, embedding_dim=128, num_hidden_layers=2, num_blocks=2, num_heads=4,
                  chunk_size=8),
    # rescale_every=2: blocks 2 and 3 get weights divided on the first inference forward (RWKVAdapter.prepare)
    "rwkv": dict(_SPECIAL, hidden_size=32, attention_hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 rescale_every=2, context_length=256),
})
RECURRENT = ("mamba", "mamba2", "lfm2", "qwen3_next", "jamba", "falcon_h1", "recurrent_gemma", "minimax", "xlstm",
             "rwkv")

# Qwen-VL: a depth-1 vision tower on 2x2 patches, merged 2x2, so an image of HxW patches is H*W/4 tokens.
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 190, 191, 192, 193
_PATCH, _TEMPORAL, _CHANNELS, _MERGE = 2, 2, 3, 2
_VL_TEXT = dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
_VISION = dict(depth=1, num_heads=2, in_channels=_CHANNELS, patch_size=_PATCH, temporal_patch_size=_TEMPORAL,
               spatial_merge_size=_MERGE)
_VL_IDS = dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END)
CONFIGS.update({
    "qwen3_vl": dict(_VL_IDS, text_config=dict(_VL_TEXT, head_dim=16), vision_config=dict(
        _VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_position_embeddings=16,
        deepstack_visual_indexes=[0])),
    "qwen2_5_vl": dict(_VL_IDS, text_config=_VL_TEXT, vision_config=dict(
        _VISION, hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=8,
        fullatt_block_indexes=[0], tokens_per_second=2)),
    "qwen2_vl": dict(_VL_IDS, text_config=_VL_TEXT, vision_config=dict(
        _VISION, embed_dim=32, hidden_size=64, mlp_ratio=2)),
})
QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Gemma 3 with images: a 16x16 image of 4x4 patches, pooled to 4 tokens, between begin/end-of-image.
GEMMA3_IMAGE, GEMMA3_BOI, GEMMA3_EOI = 125, 126, 127
CONFIGS["gemma3"] = dict(
    image_token_id=GEMMA3_IMAGE, boi_token_id=GEMMA3_BOI, eoi_token_id=GEMMA3_EOI, mm_tokens_per_image=4,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    text_config=dict(_COMMON, sliding_window=WINDOW, query_pre_attn_scalar=8,
                     layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]),
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       image_size=16, patch_size=4))
IMAGE_TEXT = (*QWEN_VL, "gemma3")  # built with AutoModelForImageTextToText
_STANDARD = ("llama", "qwen3", "qwen2", "mistral", "gemma2", "gemma3_text")
SLIDING = ("gemma2", "gemma3_text")
_EAGER_ONLY = ("gemma2", "mamba", "mamba2", "xlstm", "rwkv")  # transformers has no sdpa path for these


def tiny_config(model_type: str) -> Any:
    """The tiny config of ``model_type``."""
    from transformers import AutoConfig

    from ..errors import UnsupportedModelError

    if model_type not in CONFIGS:
        raise UnsupportedModelError(f"no tiny config for {model_type!r}", expected=sorted(CONFIGS),
                                    found=model_type, fix="pick one of the listed model types")
    extra = _COMMON if model_type in _STANDARD else {}
    return AutoConfig.for_model(model_type, **{**extra, **CONFIGS[model_type]})


def _backend(model_type: str, attn: str | None) -> str:
    return attn or ("eager" if model_type in _EAGER_ONLY else "sdpa")


def tiny_model(model_type: str, seed: int = 0, attn: str | None = None) -> Any:
    """A fresh fp32 instance in eval mode; the same seed gives the same weights."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if model_type in IMAGE_TEXT else AutoModelForCausalLM
    model = auto.from_config(tiny_config(model_type), dtype=torch.float32,
                             attn_implementation=_backend(model_type, attn))
    # No EOS: every greedy run makes exactly max_new_tokens, so rows stay comparable.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def tiny_prompt(length: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    """Random token ids ``[batch, length]`` avoiding the special ids 0..2."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, _COMMON["vocab_size"], (batch, length), generator=gen)


def tiny_image(grid_hw: tuple[int, int] = (4, 6), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A synthetic image for the tiny Qwen-VL models: ``(pixel_values, image_grid_thw, n_tokens)``.

    ``pixel_values`` is ``[H*W, C*T*P*P]`` patches (what the processor makes), ``image_grid_thw``
    is ``[[1, H, W]]``, and the image takes ``H*W / 4`` placeholder tokens after merging.
    """
    gen = torch.Generator().manual_seed(seed)
    h, w = grid_hw
    pixels = torch.randn(h * w, _CHANNELS * _TEMPORAL * _PATCH * _PATCH, generator=gen)
    return pixels, torch.tensor([[1, h, w]]), (h // _MERGE) * (w // _MERGE)


def tiny_video(frames: int = 2, grid_hw: tuple[int, int] = (4, 4), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic video for the tiny Qwen-VL models: ``(pixel_values_videos, video_grid_thw)``.

    ``frames`` temporal patches (each 2 frames) of ``H x W`` patches: ``pixel_values_videos`` is
    ``[frames*H*W, C*T*P*P]``, ``video_grid_thw`` is ``[[frames, H, W]]``.
    """
    gen = torch.Generator().manual_seed(seed)
    h, w = grid_hw
    pixels = torch.randn(frames * h * w, _CHANNELS * _TEMPORAL * _PATCH * _PATCH, generator=gen)
    return pixels, torch.tensor([[frames, h, w]])


def video_span(model_type: str, grid: torch.Tensor, seed: int = 20) -> torch.Tensor:
    """``[1, n]`` ids of one video as the processor lays it out: Qwen3-VL puts each temporal patch in
    its own run after a timestamp (2 text tokens here); Qwen2/2.5-VL use one run for the whole video."""
    t, h, w = (int(x) for x in grid[0])
    per_frame = h * w // _MERGE**2
    if model_type != "qwen3_vl":
        return torch.tensor([[VISION_START, *([VIDEO_TOKEN] * (t * per_frame)), VISION_END]])
    row: list[int] = []
    for k in range(t):
        row += [*tiny_prompt(2, seed=seed + k)[0].tolist(), VISION_START, *([VIDEO_TOKEN] * per_frame), VISION_END]
    return torch.tensor([row])


def gemma3_image(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [1, 6], pixel_values [1, 3, 16, 16])``: one image for the tiny Gemma 3."""
    gen = torch.Generator().manual_seed(seed)
    span = torch.tensor([[GEMMA3_BOI, *[GEMMA3_IMAGE] * 4, GEMMA3_EOI]])
    return span, torch.randn(1, 3, 16, 16, generator=gen)


def image_span(n_tokens: int) -> torch.Tensor:
    """``[1, n + 2]`` ids: vision start, ``n`` image placeholders, vision end."""
    return torch.tensor([[VISION_START, *([IMAGE_TOKEN] * n_tokens), VISION_END]])
