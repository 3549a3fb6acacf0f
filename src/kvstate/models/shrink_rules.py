"""The auto-shrinker's sizes, rule keys and per-type tables (see ``kvstate.models.shrink``)."""

from __future__ import annotations

from typing import Any

HIDDEN, FFN, HEADS, HEAD_DIM, VOCAB = 64, 128, 4, 16, 256
POSITIONS, WINDOW, STATE, EXPERTS, TOP_K = 512, 8, 8, 4, 2
MIN_LAYERS, MAX_LAYERS = 2, 6  # layer-kind combinations beyond MAX_LAYERS fall back to covering each value once
KEEP_IDS_BELOW = 64  # special token ids below this keep their value

# ---------------------------------------------------------------------------------------------------------------
# Rule tables, by attribute name, applied in every (sub-)config that has the attribute.
# SET replaces any positive int, CAP only lowers it, RATIO keeps its ratio to the model width (multiples of 8).
# ---------------------------------------------------------------------------------------------------------------
SET: dict[str, int] = {
    # one width for every tower, so cross-references between sub-configs stay equal
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "embed_dim", "embedding_dim", "emb_dim", "lru_width",
                     "out_hidden_size", "text_hidden_size", "audio_hidden_size", "backbone_hidden_size",
                     "hidden_size_global", "cross_attention_hidden_size", "projector_input_dim",
                     "projector_output_dim", "vision_output_dim", "adapter_in_dim", "adapter_out_dim",
                     "adapter_input_size", "ple_embed_dim", "prompt_mid_dim", "ext_pw_out_channel",
                     "depthwise_separable_out_channel", "nemo_conv_channels"), HIDDEN),
    **dict.fromkeys(("head_dim", "swa_head_dim", "attention_head_dim", "d_head", "dim_head", "attention_head_size",
                     "d_kv", "kv_channels", "query_pre_attn_scalar"), HEAD_DIM),
    **dict.fromkeys(("vocab_size", "unpadded_vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input",
                     "shape_vocab_size", "pronunciation_vocab_size"), VOCAB),
}
RATIO = ("attention_hidden_size", "embedding_size", "input_embedding_size", "output_embedding_size",
         "word_embed_proj_dim")
CAP: dict[str, int] = {
    **dict.fromkeys(("intermediate_size", "n_inner", "d_inner", "ffn_dim", "d_ff", "dim_ff", "dff", "mlp_dim",
                     "encoder_ffn_dim", "decoder_ffn_dim", "ffn_hidden_size", "feed_forward_size",
                     "intermediate_size_mlp", "dense_intermediate_size", "prefix_dense_intermediate_size",
                     "intermediate_multiple_size"), FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                     "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size",
                     "expert_ffn_hidden_size", "hidden_size_per_layer_input", "laurel_rank", "router_hidden_size",
                     "moe_latent_size", "gated_norm_rank", "loop_gate_rank", "shape_embed_dim",
                     "pronunciation_embed_dim", "output_channels"), HIDDEN // 2),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions", "max_seq_len",
                     "model_max_length", "context_length"), POSITIONS),
    **dict.fromkeys(("sliding_window", "attention_window_size", "sliding_window_size", "attention_chunk_size",
                     "local_attention_window_len", "window_size", "block_size", "keep_window_size"), WINDOW),
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size", "time_step_rank", "mamba_dt_rank",
                     "chunk_size", "mamba_chunk_size"), STATE),
    # MLA (qk_head_dim and a head_dim tied to these follow in _mla) and sparse-attention indexers
    "kv_lora_rank": 32, "q_lora_rank": 32, "o_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "index_head_dim": 16, "indexer_head_dim": 16, "index_n_heads": 2, "indexer_n_heads": 2,
    "indexer_kv_heads": 1, "index_topk": 4, "indexer_budget": 4, "index_block_size": 4, "index_topk_blocks": 2,
    # MoE (n_group = 1 is kept, see _moe)
    **dict.fromkeys(("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k",
                     "top_k_experts"), TOP_K),
    **dict.fromkeys(("n_group", "num_expert_group"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "topk_group",
                     "zero_expert_num"), 1),
    # layer patterns: one dense layer first, periods of 2 (both kinds within 2 layers), offsets inside the period
    **dict.fromkeys(("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", "attn_layer_offset",
                     "expert_layer_offset", "num_nextn_predict_layers", "num_mtp_layers"), 1),
    **dict.fromkeys(("attn_layer_period", "expert_layer_period", "sliding_window_pattern", "_sliding_window_pattern",
                     "full_attention_interval", "global_attn_every_n_layers", "no_rope_layer_interval",
                     "interleave_moe_layer_step", "decoder_sparse_step", "moe_layer_interval",
                     "n_layers_per_attn_res_block"), 2),
    # vision / audio towers: built, never run by a text-only forward
    "image_size": 32, "num_position_embeddings": 64,
    # centroid-ordered output embeddings (gemma4 assistants): centroids must divide the vocabulary
    "num_centroids": 16, "centroid_intermediate_top_k": 4,
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                "num_decoder_layers", "num_encoder_layers", "depth", "conf_num_hidden_layers", "n_recurrent_layers",
                "num_global_layers", "num_blocks")
# Lists of layer indices (remapped onto the kept layers); any other list as long as the layer count is per-layer.
INDEX_LISTS = ("mlp_only_layers", "moe_layers", "global_attn_indexes", "full_attn_idxs", "attn_layer_indices",
               "hybrid_layer_ids", "local_layer_ids", "ple_layer_ids", "cross_attention_layers",
               "mtp_local_layer_ids", "fullatt_block_indexes", "deepstack_visual_indexes",
               "intermediate_layers_indices", "swa_layers")
CYCLES = ("block_types",)  # lists repeated cyclically over the layers: at least one full cycle is kept
Q_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "encoder_attention_heads",
           "decoder_attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads",
           "conf_num_attention_heads", "swa_num_attention_heads", "linear_num_heads")
KV_HEADS = {"num_key_value_heads": "num_attention_heads", "num_kv_heads": "num_attention_heads",  # kv -> its q
            "num_query_groups": "num_attention_heads", "swa_num_key_value_heads": "swa_num_attention_heads"}
CAUSAL_FLAGS = {"is_decoder": True, "causal": True}  # encoder families used as causal LMs: causal, with a cache
TOKEN_ID_SUFFIXES = ("_token_id", "_token_ids", "_token_index", "suppress_tokens")
TOKEN_IDS = ("mask_index", "unk_index")

# ---------------------------------------------------------------------------------------------------------------
# Per-type overrides, applied after the rules (a dict for a sub-config merges into it). One line of reason each.
# ---------------------------------------------------------------------------------------------------------------
_QSA = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
        "indexer_compress_ratio": 4}
OVERRIDES: dict[str, dict[str, Any]] = {
    # DbrxAttention reads attn_config.rope_theta (undefined there) and clamps by clip_qkv even when it is None.
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # The rotary embedding looks rope_parameters up by layer type; the default is not keyed that way.
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [3, 3, 2]}}},
    # The default leaves the MoE unset (no experts, no top-k) although every layer but the first is sparse.
    "dots1": {"n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_shared_experts": 1},
    # Indexed-attention layers need the QSA indexer, which the defaults leave unset.
    "qwen4_exp_text": _QSA,
    "qwen4_exp": {"text_config": _QSA},
    # The defaults have no attention layer; a hybrid needs one for its cache mask (and to be a hybrid).
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # layer_types defaults to None; with one dense layer this gives conv x {dense, MoE} and attention x MoE.
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "conv", "full_attention"]},
    # Periods 2/2 would pair attention with experts, which the original never does (attention 4/2, experts 2/1).
    "jamba": {"num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 2},
    # Hybrid layers tie their shared transformer to the first hybrid layer: two of them so the tie has a target.
    "zamba": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2},
    # Input / recurrent / output sections must sum to the layer count: one layer each.
    "dory": {"num_hidden_layers": 3, "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # The looped core must be whole attention-residual blocks after the first block: 2 blocks of 2 layers.
    "inkling2_loop_text": {"num_hidden_layers": 4, "n_layers_per_attn_res_block": 2, "loop_num_passes": 2,
                           "layer_types": ["hybrid_sliding", "hybrid"] * 2, "loop_layer_index_start": 2,
                           "loop_layer_index_end": 4},
    # attention_layers is derived from this run-length pattern: one (global, local) pair.
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # Axial position embedding dims must sum to the width.
    "reformer": {"axial_pos_embds_dim": [32, 32]},
    # qk_dim is rounded up to a multiple of 64 in the config but not in the kernel: width 128 keeps them equal.
    "xlstm": {"hidden_size": 128, "embedding_dim": 128},
    # Adapters are per language; the forward needs one picked.
    "xmod": {"default_language": "en_XX"},
    # The check feeds (batch, seq) ids; the decoder reads rows as batch x codebooks, so one codebook.
    "musicgen": {"decoder": {"num_codebooks": 1}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1}},
    # The depth decoder's input is the main model's width (an attribute named like the audio feature size).
    "moshi": {"depth_decoder_config": {"input_size": HIDDEN}},
    # The image pools to mm_tokens_per_image: a square that divides the 2 x 2 patches the shrunk tower makes.
    "gemma3": {"mm_tokens_per_image": 4},
    # BltConfig has no num_hidden_layers but the model sizes its DynamicCache from it; hash vocabulary small.
    "blt": {"num_hidden_layers": 2, "encoder_hash_byte_group_vocab": 1024},
}
# Starting points where AutoConfig.for_model's own defaults do not validate.
BASE: dict[str, dict[str, Any]] = {
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
}
# mrope_section the modeling code falls back to when rope_parameters has none (sized for the full head).
CODE_MROPE: dict[str, tuple[int, ...]] = dict.fromkeys(
    ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "qwen4_exp_text"), (11, 11, 10))
# Types whose tiny model cannot be built and run here, and why.
_DRAFT = ("a speculative-decoding draft model: its forward ignores input_ids and needs the target model's "
          "inputs_embeds and shared_kv_states")
UNBUILDABLE: dict[str, str] = {
    "gemma3n": "its vision tower is a TimmWrapperModel: needs timm (not installed; timm also needs torchvision)",
    "gemma4_assistant": _DRAFT,
    "gemma4_unified_assistant": _DRAFT,
}
