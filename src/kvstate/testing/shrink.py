"""Auto-shrinker: a tiny random-weight model for any causal-LM ``model_type`` in the installed transformers.

Design
------
``shrink_config(model_type)`` starts from ``AutoConfig.for_model(model_type)`` (the library's own defaults, so
nothing is downloaded) and rewrites it with *rules* keyed by attribute name, applied alike to the top config and,
recursively, to every nested sub-config (``text_config``, ``vision_config``, ``audio_config``, ``decoder``, ...):

* sizes (``SET`` / ``CAP`` / ``RATIO``): every width is 64 and every head 16 wide in all sub-configs alike, so
  cross-references between them (projector dims, ``out_hidden_size`` vs the text width, ...) stay equal;
* attention keeps its head layout class: MHA stays MHA, MQA stays MQA, GQA becomes 4 query / 2 key-value heads;
* rotary: ``rotary_dim`` keeps its share of the head, ``mrope_section`` sums to half the rotary dims, the
  partial-rotary factor is kept;
* MLA, MoE, SSM (mamba / mamba2 heads x head dim = expand x width) and linear-attention sizes shrink together;
* layers: the kept layers are the first layer of each *kind*, a kind being the combination of a layer's entries in
  every per-layer list (``layer_types``, ``mlp_layer_types``, ``per_layer_config``, ...) and its membership of
  every layer-index list (``mlp_only_layers``, ...); at least 2 layers. Per-layer lists are cut and index lists
  remapped to the kept layers; periodic knobs become a period of 2 and one leading dense layer;
* vocabulary 256: special token ids below 64 keep their value, larger ones are packed in order at the top of the
  vocabulary (so equal ids stay equal); an id equal to the vocabulary size (an extra embedding row) follows it;
* positions 512, sliding windows / chunks 8, SSM states 8; encoder families get ``is_decoder`` / ``causal``.

Only declared config fields are passed back (``AutoConfig.for_model(model_type, **changes)``), so values a class
derives in ``__post_init__`` are re-derived from the shrunk ones and its own validation runs; sub-configs are
rebuilt as objects from their customised fields plus their changes.

What the rules cannot express is in small tables, one line of reason per entry: ``OVERRIDES`` (applied last),
``BASE`` (defaults that do not validate), ``CODE_MROPE`` (rope sections the modeling code assumes). Types that
cannot be built and run here are in ``UNBUILDABLE``; ``tiny_causal_lm`` raises ``UnsupportedModelError`` for them.
``tiny_causal_lm`` builds the class ``AutoModelForCausalLM`` maps the config to, from the sub-config that class
takes where it differs (musicgen's ``MusicgenForCausalLM`` takes the ``decoder`` config).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import UnsupportedModelError

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


def shrink_config(model_type: str) -> Any:
    """A small config for ``model_type``: ``AutoConfig.for_model(model_type)`` defaults, shrunk consistently."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type, **BASE.get(model_type, {}))
    if model_type in CODE_MROPE:  # make the code's fallback explicit, so the rope rule shrinks it
        text = vars(base).get("text_config") or base
        text.rope_parameters = {"mrope_section": list(CODE_MROPE[model_type]), **(text.rope_parameters or {})}
    ids = _token_map(base)
    changes = _merge(base, _shrink(base, ids), OVERRIDES.get(model_type, {}))
    return AutoConfig.for_model(model_type, **_materialise(base, changes))


def tiny_causal_lm(model_type: str, seed: int = 0, attn: str | None = None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(shrink_config(model_type))``: fp32, eval mode, seeded.

    ``generation_config.eos_token_id`` is ``None`` (every greedy run makes exactly ``max_new_tokens``) and
    ``pad_token_id`` is a valid id.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(f"{model_type!r} is not a causal-LM model_type of this transformers",
                                    expected="a key of MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", found=model_type,
                                    fix="pick a causal-LM model type")
    if model_type in UNBUILDABLE:
        raise UnsupportedModelError(f"cannot build a tiny {model_type!r} here", expected="a buildable model_type",
                                    found=f"{model_type}: {UNBUILDABLE[model_type]}",
                                    fix="pick another model type, or install what the reason names")

    config = shrink_config(model_type)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    config = _config_for(cls, config)
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn} if attn else {}
    model = cls._from_config(config, dtype=torch.float32, **kwargs)
    model.generation_config.eos_token_id = None
    text = config.get_text_config(decoder=True)
    rows = getattr(model.get_input_embeddings(), "num_embeddings", text.vocab_size)
    pad = _first_id(getattr(text, "pad_token_id", None), getattr(config, "pad_token_id", None),
                    getattr(text, "eos_token_id", None), 0)
    model.generation_config.pad_token_id = pad if 0 <= pad < rows else 0
    # MusicgenForCausalLM.generate starts its delay pattern at decoder_start_token_id and expands the batch by
    # num_return_sequences without defaulting either.
    if model.generation_config.decoder_start_token_id is None and _is_int(getattr(text, "bos_token_id", None)):
        model.generation_config.decoder_start_token_id = text.bos_token_id
    if model.generation_config.num_return_sequences is None:
        model.generation_config.num_return_sequences = 1
    return model.eval()


def _config_for(cls: type, config: Any) -> Any:
    """The config ``cls`` takes: ``config`` itself, or its sub-config of the class ``cls`` declares (musicgen's
    ``MusicgenForCausalLM`` is the auto causal-LM class of ``MusicgenConfig`` but takes its ``decoder`` config)."""
    from transformers import PretrainedConfig

    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    return next((v for v in vars(config).values() if isinstance(v, PretrainedConfig) and isinstance(v, wanted)),
                config)


# ---------------------------------------------------------------------------------------------------------------
# The rules
# ---------------------------------------------------------------------------------------------------------------
Rule = Callable[[dict[str, Any], dict[str, Any]], None]


def _shrink(cfg: Any, ids: dict[int, int], top: bool = True) -> dict[str, Any]:
    """The changed attributes of ``cfg`` (sub-configs as nested dicts of their changes)."""
    from transformers import PretrainedConfig

    old = {k: v for k, v in vars(cfg).items() if not k.startswith("__")}
    new: dict[str, Any] = {}
    for rule in RULES:
        rule(old, new)
    _tokens(old, new, ids)
    if top and not old.get("is_encoder_decoder"):
        new.update({k: v for k, v in CAUSAL_FLAGS.items() if old.get(k) is False})
    for key, value in old.items():
        if isinstance(value, PretrainedConfig):
            new[key] = _shrink(value, ids, top=False)
    return _declared(type(cfg), new)


def _declared(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """Only the declared fields (and ``per_layer_config``): the class re-derives the rest in ``__post_init__``."""
    import dataclasses

    if not dataclasses.is_dataclass(cls):
        return values
    names = {f.name for f in dataclasses.fields(cls)} | {"per_layer_config"}
    alias = {stored: name for name, stored in getattr(cls, "attribute_map", {}).items() if name in names}
    return {k if k in names else alias[k]: v for k, v in values.items() if k in names or k in alias}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sizes(old: dict[str, Any], new: dict[str, Any]) -> None:
    """The SET and CAP tables."""
    for key, value in old.items():
        if key in SET or key in CAP:
            shrunk = _size(key, value)
            if shrunk != value:
                new[key] = shrunk


def _size(key: str, value: Any) -> Any:
    if isinstance(value, list):  # one size per layer
        return [_size(key, v) for v in value]
    if not _is_int(value) or value <= 0:
        return value
    return SET[key] if key in SET else min(value, CAP[key])


def _ratios(old: dict[str, Any], new: dict[str, Any]) -> None:
    """RATIO widths keep their ratio to the width: zamba's attention runs on [hidden, embeddings] (2x), electra
    embeds at half the width; an attention head then keeps its share of such a width."""
    width = _width(old)
    for key in RATIO:
        if width and _is_int(old.get(key)) and old[key] > 0:
            new[key] = max(8, 8 * round(old[key] / width * HIDDEN / 8))
    attn, head = old.get("attention_hidden_size"), old.get("attention_head_dim")
    if _is_int(attn) and _is_int(head) and head * (_q_heads(old) or 0) == attn:
        new["attention_head_dim"] = new["attention_hidden_size"] // HEADS


def _heads(old: dict[str, Any], new: dict[str, Any]) -> None:
    """4 query heads; kv heads keep the layout class (MHA 4, MQA 1, GQA 2)."""
    for key in Q_HEADS:
        if _is_int(old.get(key)) and old[key] > 0:
            new[key] = HEADS
    for kv, q in KV_HEADS.items():
        n_kv, n_q = old.get(kv), old.get(q)
        if _is_int(n_kv) and _is_int(n_q):
            new[kv] = HEADS if n_kv == n_q else 1 if n_kv == 1 else 2
        elif kv == "num_key_value_heads" and kv in old and n_kv is None and _is_int(n_q):
            new[kv] = HEADS  # unset means MHA; some models read it without deriving it
    if "head_dim" in old and old["head_dim"] is None and _is_int(_q_heads(old)) and _width(old):
        new["head_dim"] = HEAD_DIM  # unset means width / heads; some models read it without deriving it


def _rotary(old: dict[str, Any], new: dict[str, Any]) -> None:
    """``rotary_dim`` keeps its share of the head; rope lists fit the rotary half-dim of the new head."""
    head = old.get("head_dim") or _div(_width(old), _q_heads(old))
    for key in ("rotary_dim", "rotary_emb_base_dim"):
        if _is_int(old.get(key)) and head:
            new[key] = max(2, 2 * round(old[key] / head * HEAD_DIM / 2))
    rope = old.get("rope_parameters")
    if isinstance(rope, dict):
        shrunk = _rope(rope, old.get("partial_rotary_factor") or 1.0)
        if shrunk != rope:
            new["rope_parameters"] = shrunk


def _rope(rope: dict[str, Any], partial: float) -> dict[str, Any]:
    """``mrope_section`` sums to, and longrope factor lists have, half the rotary dims (partial factor kept)."""
    partial = rope.get("partial_rotary_factor") or partial
    out = {k: _rope(v, partial) if isinstance(v, dict) else v for k, v in rope.items()}
    half = max(1, int(HEAD_DIM * partial) // 2)
    section = out.get("mrope_section")
    if isinstance(section, list) and sum(section) != half:
        out["mrope_section"] = _scale_to_sum(section, half)
    for key in ("short_factor", "long_factor"):
        if isinstance(out.get(key), list):
            out[key] = out[key][:half]
    if _is_int(out.get("original_max_position_embeddings")):  # keep the scaling factor = max / original
        factor = out.get("factor") if isinstance(out.get("factor"), int | float) else 4
        out["original_max_position_embeddings"] = max(1, int(POSITIONS // factor))
    return out


def _scale_to_sum(parts: list[int], total: int) -> list[int]:
    """Proportional integer parts summing to ``total`` (largest remainders round up)."""
    exact = [p * total / sum(parts) for p in parts]
    scaled = [int(x) for x in exact]
    for i in sorted(range(len(parts)), key=lambda i: scaled[i] - exact[i])[: total - sum(scaled)]:
        scaled[i] += 1
    return scaled


def _mla(old: dict[str, Any], new: dict[str, Any]) -> None:
    """MLA: ``qk_head_dim`` = nope + rope; a ``head_dim`` that equalled one MLA dim follows it."""
    if not _is_int(old.get("qk_rope_head_dim")):
        return
    dims = {k: new.get(k, old.get(k)) for k in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")}
    if _is_int(dims["qk_nope_head_dim"]):
        dims["qk_head_dim"] = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
        if _is_int(old.get("qk_head_dim")):
            new["qk_head_dim"] = dims["qk_head_dim"]
    original = {k: old.get(k) for k in ("qk_rope_head_dim", "qk_head_dim", "v_head_dim", "qk_nope_head_dim")}
    if _is_int(old.get("qk_nope_head_dim")):
        original["qk_head_dim"] = old["qk_nope_head_dim"] + old["qk_rope_head_dim"]
    for key, value in original.items():
        if _is_int(old.get("head_dim")) and old["head_dim"] == value:
            new["head_dim"] = dims[key]
            break


def _moe(old: dict[str, Any], new: dict[str, Any]) -> None:
    """Keep ``n_group`` = 1 where it was 1 (and its ``topk_group``); top-k never above the expert count."""
    for group in ("n_group", "num_expert_group"):
        if old.get(group) == 1:
            new.pop(group, None)
            new.pop("topk_group", None)
    experts = next((new.get(k, old[k]) for k in ("n_routed_experts", "num_experts", "num_local_experts",
                                                  "moe_num_experts") if _is_int(old.get(k))), None)
    for key in ("num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts", "num_experts_per_token", "moe_top_k"):
        if experts and key in old and old[key] is None:
            new[key] = min(TOP_K, experts)  # an unset top-k with experts set (deepseek_v2's default)
        elif experts and _is_int(new.get(key, old.get(key))) and new.get(key, old[key]) > experts:
            new[key] = experts


def _ssm(old: dict[str, Any], new: dict[str, Any]) -> None:
    """Mamba2-style heads: ``num_heads * head_dim == expand * hidden``; groups divide the heads."""
    expand = next((old[k] for k in ("mamba_expand", "expand") if _is_int(old.get(k))), None)
    if expand is None:
        return
    inner = expand * HIDDEN
    pairs = [("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"),
             ("n_mamba_heads", "mamba_headdim")]
    if "n_groups" in old:  # mamba2 names its SSM heads like attention heads
        pairs.append(("num_heads", "head_dim"))
    for heads, dim in pairs:
        if _is_int(old.get(heads)) and _is_int(old.get(dim)):
            new[dim], new[heads] = HEAD_DIM, inner // HEAD_DIM
    if _is_int(old.get("mamba_d_ssm")):
        new["mamba_d_ssm"] = inner
    for key in ("n_groups", "mamba_n_groups", "mamba_ngroups"):
        if _is_int(old.get(key)) and old[key] > 1:
            new[key] = 2


def _linear_attention(old: dict[str, Any], new: dict[str, Any]) -> None:
    """Gated-delta / linear-attention heads 16 wide (values twice that where they were wider than keys)."""
    k_heads, v_heads = old.get("linear_num_key_heads"), old.get("linear_num_value_heads")
    if _is_int(k_heads) and _is_int(v_heads):
        new["linear_num_key_heads"] = 2
        new["linear_num_value_heads"] = 2 * (v_heads // k_heads if v_heads % k_heads == 0 else 1)
    k_dim, v_dim = old.get("linear_key_head_dim"), old.get("linear_value_head_dim")
    if _is_int(k_dim) and _is_int(v_dim):
        new["linear_key_head_dim"] = HEAD_DIM
        new["linear_value_head_dim"] = HEAD_DIM * (2 if v_dim > k_dim else 1)
    if _is_int(old.get("linear_head_dim")):
        new["linear_head_dim"] = HEAD_DIM


def _layers(old: dict[str, Any], new: dict[str, Any]) -> None:
    """Pick a layer subset covering every kind of layer; cut per-layer lists and remap index lists to it."""
    counts = [k for k in LAYER_COUNTS if _is_int(old.get(k)) and old[k] > 0]
    if not counts:
        return
    n = old[counts[0]]
    per_layer = {k: v for k, v in old.items() if isinstance(v, list | tuple) and len(v) == n and n > 1
                 and k not in INDEX_LISTS and not _is_token_key(k) and k != "architectures"}
    index = {k: [i % n for i in old[k]] for k in INDEX_LISTS
             if isinstance(old.get(k), list | tuple) and all(_is_int(i) for i in old[k])}
    overrides = _per_layer_overrides(old, n)
    if overrides:
        per_layer["per_layer_config"] = overrides
    shared = old.get("num_kv_shared_layers")
    if _is_int(shared) and shared > 0:  # the last `shared` layers reuse earlier layers' KV: keep both sides
        per_layer["num_kv_shared_layers"] = [i >= n - shared for i in range(n)]
    cycle = max((len(old[k]) for k in CYCLES if isinstance(old.get(k), list | tuple)), default=0)
    keep = _select(n, per_layer, index, max(MIN_LAYERS, cycle))
    for key in counts:
        new[key] = min(old[key], len(keep)) if key != counts[0] else len(keep)
        new[key] = max(new[key], 1)
    for key, values in per_layer.items():
        new[key] = [new.get(key, values)[i] for i in keep]  # the sizes rule may have shrunk the entries
    for key, indices in index.items():
        new[key] = [j for j, i in enumerate(keep) if i in indices]
    if overrides:
        new["per_layer_config"] = {j: _shrink_layer(old, d) for j, d in enumerate(new["per_layer_config"]) if d}
    if "num_kv_shared_layers" in per_layer:
        new["num_kv_shared_layers"] = sum(new["num_kv_shared_layers"])
    if _is_int(old.get("moe_layer_end_index")) and old["moe_layer_end_index"] >= 0:
        new["moe_layer_end_index"] = len(keep) - 1  # MoE from moe_layer_start_index to the last layer


def _per_layer_overrides(old: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """A heterogeneous config's ``per_layer_config`` as one dict per layer (all its per-layer attributes)."""
    spec = old.get("_heterogeneity_spec")
    if spec is None:
        return []
    return [{**{k: old.get(k) for k in spec.explicit_per_layer_attributes}, **spec.per_layer_overrides.get(i, {})}
            for i in range(n)]


def _shrink_layer(old: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    """One layer's overrides, shrunk by the same rules as the global values they replace."""
    merged, new = {**old, **layer}, {}
    for rule in (_sizes, _heads, _rotary, _mla, _moe):
        rule(merged, new)
    return {k: new.get(k, v) for k, v in layer.items()}


def _select(n: int, per_layer: dict[str, list[Any]], index: dict[str, list[int]], least: int) -> list[int]:
    """The first layer of each kind, a kind being the combination of its entries in all per-layer lists and index
    lists (attention type x MLP type x ...); if that needs more than MAX_LAYERS layers, each entry value on its own."""
    def kinds(i: int) -> list[tuple[str, str]]:
        return [(k, json.dumps(v[i], sort_keys=True, default=str)) for k, v in per_layer.items()] + [
            (k, str(i in v)) for k, v in index.items()]

    combos: dict[str, int] = {}
    for i in range(n):
        combos.setdefault(json.dumps(kinds(i)), i)
    keep = sorted(combos.values())
    if len(keep) > MAX_LAYERS:
        seen: set[tuple[str, str]] = set()
        keep = [i for i in range(n) if not set(kinds(i)) <= seen and not seen.update(kinds(i))]
    extra = [i for i in range(n) if i not in keep]
    return sorted(keep + extra[: max(0, min(least, n) - len(keep))])


RULES: tuple[Rule, ...] = (_sizes, _ratios, _heads, _rotary, _mla, _moe, _ssm, _linear_attention, _layers)


# ---------------------------------------------------------------------------------------------------------------
# Special token ids
# ---------------------------------------------------------------------------------------------------------------
def _is_token_key(key: str) -> bool:
    return key.endswith(TOKEN_ID_SUFFIXES) or key in TOKEN_IDS


def _token_map(cfg: Any) -> dict[int, int]:
    """Old id -> new id for every special token id anywhere in the config tree."""
    found = {i for i in _all_ids(cfg) if i >= KEEP_IDS_BELOW}
    top = VOCAB - len(found)
    return {i: top + rank for rank, i in enumerate(sorted(found))}


def _all_ids(cfg: Any) -> Iterable[int]:
    from transformers import PretrainedConfig

    for key, value in vars(cfg).items():
        if isinstance(value, PretrainedConfig):
            yield from _all_ids(value)
        elif _is_token_key(key) and value != getattr(cfg, "vocab_size", None):
            yield from (v for v in _flat(value) if v >= 0)


def _flat(value: Any) -> list[int]:
    if _is_int(value):
        return [value]
    if isinstance(value, list | tuple):
        return [i for v in value for i in _flat(v)]
    return []


def _tokens(old: dict[str, Any], new: dict[str, Any], ids: dict[int, int]) -> None:
    """Map special ids into the vocabulary; an id equal to the vocab size (an extra row) follows it."""
    vocab = old.get("vocab_size")
    for key, value in old.items():
        if _is_token_key(key) and _flat(value):
            mapped = _map_ids(value, ids, vocab, new.get("vocab_size", vocab))
            if mapped != value:
                new[key] = mapped


def _map_ids(value: Any, ids: dict[int, int], vocab: Any, new_vocab: Any) -> Any:
    if isinstance(value, list | tuple):
        return type(value)(_map_ids(v, ids, vocab, new_vocab) for v in value)
    if _is_int(value) and value == vocab:
        return new_vocab
    return ids.get(value, value) if _is_int(value) else value


# ---------------------------------------------------------------------------------------------------------------
# Putting a config back together
# ---------------------------------------------------------------------------------------------------------------
def _materialise(cfg: Any, changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` with sub-config dicts replaced by rebuilt sub-config objects."""
    from transformers import PretrainedConfig

    out = dict(changes)
    for key, value in changes.items():
        sub = vars(cfg).get(key)
        if isinstance(sub, PretrainedConfig) and isinstance(value, dict):
            out[key] = type(sub)(**{**_customised(sub), **_materialise(sub, value)})
    return out


def _customised(cfg: Any) -> dict[str, Any]:
    """The fields of ``cfg`` that differ from its class defaults (what a parent config set on it)."""
    try:
        default = vars(type(cfg)())
    except Exception:  # a class without defaults: keep everything
        default = {}
    return _declared(type(cfg), {k: v for k, v in vars(cfg).items() if default.get(k, object()) != v
                                 and k not in ("transformers_version", "architectures")})


def _merge(cfg: Any, changes: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``changes`` updated by ``extra``; dicts for sub-configs merge, any other value replaces."""
    from transformers import PretrainedConfig

    out = dict(changes)
    for key, value in extra.items():
        sub = vars(cfg).get(key)
        out[key] = _merge(sub, out.get(key, {}), value) if isinstance(sub, PretrainedConfig) else value
    return out


def _width(old: dict[str, Any]) -> int | None:
    return next((old[k] for k in ("hidden_size", "n_embd", "d_model", "embed_dim") if _is_int(old.get(k))), None)


def _q_heads(old: dict[str, Any]) -> int | None:
    return next((old[k] for k in Q_HEADS if _is_int(old.get(k))), None)


def _div(a: int | None, b: int | None) -> int | None:
    return a // b if a and b else None


def _first_id(*values: Any) -> int:
    for value in values:
        flat = _flat(value)
        if flat:
            return flat[0]
    return 0
