"""Auto-shrinker: a tiny random-weight model for any causal-LM ``model_type`` in the installed transformers.

Design
------
``shrink_config(model_type)`` starts from ``AutoConfig.for_model(model_type)`` (the library's own defaults, so
nothing is downloaded) and rewrites it with *rules* keyed by attribute name, applied to the top config and,
recursively, to every nested sub-config (``text_config``, ``vision_config``, ``audio_config``, ...):

* every width is 64 and every head is 16 wide, in all sub-configs alike, so cross-references between them
  (projector input dims, ``out_hidden_size`` vs the text width, ...) stay consistent without special cases;
* attention keeps its head layout class: MHA stays MHA, MQA stays MQA, GQA becomes 4 query / 2 key-value heads;
* MLA, MoE, SSM (mamba/mamba2) and linear-attention sizes shrink together so their derived products agree;
* layers: at least 2, and the layer subset is chosen so that every kind of layer the original has (in
  ``layer_types``, ``mlp_layer_types``, index lists such as ``mlp_only_layers``, ...) appears at least once;
  periodic knobs (``attn_layer_period``, ``sliding_window_pattern``, ``first_k_dense_replace``, ...) shrink to
  periods of 2 / one dense layer;
* vocabulary 256; every special token id is mapped into it (ids below 64 kept, larger ones packed, in order, at the
  top of the vocabulary, so equal ids stay equal and distinct ids stay distinct);
* positions 512, sliding windows / chunks 8, SSM states 8.

Only the attributes changed by the rules are passed back to the config class (``AutoConfig.for_model(model_type,
**changes)``), so values the class derives in ``__post_init__`` are re-derived from the shrunk ones and its own
validation runs. Sub-configs are rebuilt as objects from their customised fields plus the changes.

What the rules cannot express lives in ``OVERRIDES`` (one line of reason each), applied last. Types that cannot be
built here at all are listed in ``UNBUILDABLE`` with the reason; ``tiny_causal_lm`` raises
``UnsupportedModelError`` for them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import UnsupportedModelError

HIDDEN, FFN, HEADS, HEAD_DIM, VOCAB = 64, 128, 4, 16, 256
POSITIONS, WINDOW, STATE, EXPERTS, TOP_K, MIN_LAYERS = 512, 8, 8, 4, 2, 2
KEEP_IDS_BELOW = 64  # special token ids below this keep their value

# ---------------------------------------------------------------------------------------------------------------
# Rule tables: attribute name -> new value. SET replaces any positive int; CAP only lowers.
# ---------------------------------------------------------------------------------------------------------------
SET: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "embed_dim", "word_embed_proj_dim", "embedding_dim",
                     "attention_hidden_size", "lru_width", "out_hidden_size", "projector_input_dim",
                     "projector_output_dim", "vision_output_dim", "cross_attention_hidden_size",
                     "hidden_size_global", "input_embedding_size", "output_embedding_size", "emb_dim",
                     "backbone_hidden_size", "d_inner", "audio_hidden_size"), HIDDEN),
    **dict.fromkeys(("head_dim", "swa_head_dim", "attention_head_dim", "d_head", "dim_head", "attention_head_size",
                     "d_kv", "kv_channels", "query_pre_attn_scalar"), HEAD_DIM),
    "vocab_size": VOCAB,
}
CAP: dict[str, int] = {
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim",
                     "ffn_hidden_size", "dim_ff", "dff", "feed_forward_size", "intermediate_size_mlp",
                     "dense_intermediate_size", "prefix_dense_intermediate_size", "mlp_dim",
                     "intermediate_multiple_size", "embedding_size"), FFN),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size",
                     "shared_experts_intermediate_size", "moe_shared_expert_intermediate_size",
                     "expert_ffn_hidden_size", "hidden_size_per_layer_input", "laurel_rank", "router_hidden_size",
                     "moe_latent_size", "gated_norm_rank", "loop_gate_rank"), HIDDEN // 2),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions", "max_seq_len",
                     "model_max_length", "context_length"), POSITIONS),
    **dict.fromkeys(("sliding_window", "attention_window_size", "sliding_window_size", "attention_chunk_size",
                     "local_attention_window_len", "window_size", "block_size"), WINDOW),
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size", "time_step_rank", "mamba_dt_rank",
                     "chunk_size", "mamba_chunk_size"), STATE),
    # MLA and sparse-attention indexers
    "kv_lora_rank": 32, "q_lora_rank": 32, "o_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "index_head_dim": 16, "indexer_head_dim": 16, "index_n_heads": 2, "indexer_n_heads": 2,
    "indexer_kv_heads": 1, "index_topk": 4, "indexer_budget": 4, "index_block_size": 4, "index_topk_blocks": 2,
    # MoE
    **dict.fromkeys(("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"), EXPERTS),
    **dict.fromkeys(("num_experts_per_tok", "moe_k", "moe_topk", "top_k_experts", "num_experts_per_token",
                     "moe_top_k"), TOP_K),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "first_k_dense_replace",
                     "num_dense_layers", "moe_layer_start_index", "zero_expert_num"), 1),
    **dict.fromkeys(("n_group", "num_expert_group"), 2),
    **dict.fromkeys(("topk_group",), 1),
    # periodic layer patterns: a period of 2 puts both kinds in 2 layers
    **dict.fromkeys(("attn_layer_period", "expert_layer_period", "sliding_window_pattern", "_sliding_window_pattern",
                     "full_attention_interval", "global_attn_every_n_layers", "no_rope_layer_interval",
                     "interleave_moe_layer_step", "decoder_sparse_step", "moe_layer_interval"), 2),
    **dict.fromkeys(("attn_layer_offset", "expert_layer_offset"), 1),
    **dict.fromkeys(("num_kv_shared_layers", "num_nextn_predict_layers", "num_mtp_layers"), 1),
    # vision / audio towers (built, never run by a text-only check)
    **dict.fromkeys(("image_size",), 32),
    **dict.fromkeys(("num_position_embeddings",), 64),
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers",
                "num_decoder_layers", "num_encoder_layers", "depth", "conf_num_hidden_layers", "n_recurrent_layers",
                "num_global_layers")
# Lists of layer indices (remapped onto the chosen layers); other lists as long as the layer count are per-layer.
INDEX_LISTS = ("mlp_only_layers", "moe_layers", "global_attn_indexes", "full_attn_idxs", "attn_layer_indices",
               "hybrid_layer_ids", "local_layer_ids", "ple_layer_ids", "cross_attention_layers",
               "mtp_local_layer_ids", "fullatt_block_indexes", "deepstack_visual_indexes",
               "intermediate_layers_indices", "attn_layers", "swa_layers", "no_rope_layers_idx")
# Lists that repeat cyclically over the layers: the layer count is at least their length.
CYCLES = ("block_types",)
Q_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "encoder_attention_heads",
           "decoder_attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads",
           "conf_num_attention_heads", "swa_num_attention_heads", "linear_num_heads")
# kv-heads attribute -> the query-heads attribute it pairs with
KV_HEADS = {"num_key_value_heads": "num_attention_heads", "num_kv_heads": "num_attention_heads",
            "num_query_groups": "num_attention_heads", "swa_num_key_value_heads": "swa_num_attention_heads"}
# Flags that make an encoder family (used as a causal LM) causal and cache-using.
CAUSAL_FLAGS = {"is_decoder": True, "causal": True}
TOKEN_ID_SUFFIXES = ("_token_id", "_token_ids", "_token_index", "suppress_tokens")
TOKEN_IDS = ("mask_index", "unk_index")

# ---------------------------------------------------------------------------------------------------------------
# Per-type overrides (applied after the rules; nested dicts merge into sub-configs). One line of reason each.
# ---------------------------------------------------------------------------------------------------------------
OVERRIDES: dict[str, dict[str, Any]] = {
    # DbrxAttention reads attn_config.rope_theta (undefined there) and clamps by clip_qkv even when it is None.
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # The rotary embedding looks rope_parameters up by layer type; the default is not keyed that way.
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # The defaults have no attention layer at all; a hybrid needs one for its cache (and to be a hybrid).
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
}

# Types that cannot be built here, and why.
UNBUILDABLE: dict[str, str] = {}


def shrink_config(model_type: str) -> Any:
    """A small config for ``model_type``: ``AutoConfig.for_model(model_type)`` defaults, shrunk consistently."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    ids = _token_map(base)
    changes = _merge(_shrink(base, ids), OVERRIDES.get(model_type, {}))
    return AutoConfig.for_model(model_type, **_materialise(base, changes))


def tiny_causal_lm(model_type: str, seed: int = 0, attn: str | None = None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_config(shrink_config(model_type))``: fp32, eval mode, seeded.

    ``generation_config.eos_token_id`` is ``None`` (every greedy run makes exactly ``max_new_tokens``) and
    ``pad_token_id`` is a valid id.
    """
    from transformers import AutoModelForCausalLM

    if model_type in UNBUILDABLE:
        raise UnsupportedModelError(f"cannot build a tiny {model_type!r} here", expected="a buildable model_type",
                                    found=f"{model_type}: {UNBUILDABLE[model_type]}",
                                    fix="pick another model type, or install what the reason names")
    config = shrink_config(model_type)
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    model.generation_config.eos_token_id = None
    text = config.get_text_config(decoder=True)
    pad = _first_id(getattr(text, "pad_token_id", None), getattr(config, "pad_token_id", None),
                    getattr(text, "eos_token_id", None), 0)
    model.generation_config.pad_token_id = pad if pad < text.vocab_size else 0
    return model.eval()


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
    return new


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sizes(old: dict[str, Any], new: dict[str, Any]) -> None:
    """The SET and CAP tables."""
    for key, value in old.items():
        if not _is_int(value) or value <= 0:
            continue
        if key in SET and value != SET[key]:
            new[key] = SET[key]
        elif key in CAP and value > CAP[key]:
            new[key] = CAP[key]


def _heads(old: dict[str, Any], new: dict[str, Any]) -> None:
    """4 query heads; kv heads keep the layout class (MHA 4, MQA 1, GQA 2)."""
    for key in Q_HEADS:
        if _is_int(old.get(key)) and old[key] > 0:
            new[key] = HEADS
    for kv, q in KV_HEADS.items():
        n_kv, n_q = old.get(kv), old.get(q)
        if _is_int(n_kv) and _is_int(n_q):
            new[kv] = HEADS if n_kv == n_q else 1 if n_kv == 1 else 2


def _rotary(old: dict[str, Any], new: dict[str, Any]) -> None:
    """``rotary_dim`` keeps its share of the head; ``mrope_section`` sums to half the head."""
    head = old.get("head_dim") or _div(_width(old), _q_heads(old))
    for key in ("rotary_dim", "rotary_emb_base_dim"):
        if _is_int(old.get(key)) and head:
            new[key] = max(2, 2 * round(old[key] / head * HEAD_DIM / 2))
    rope = old.get("rope_parameters")
    if isinstance(rope, dict):
        shrunk = _rope(rope)
        if shrunk != rope:
            new["rope_parameters"] = shrunk


def _rope(rope: dict[str, Any]) -> dict[str, Any]:
    out = {k: _rope(v) if isinstance(v, dict) else v for k, v in rope.items()}
    section = out.get("mrope_section")
    if isinstance(section, list) and sum(section) != HEAD_DIM // 2:
        out["mrope_section"] = _scale_to_sum(section, HEAD_DIM // 2)
    for key in ("short_factor", "long_factor"):
        if isinstance(out.get(key), list):
            out[key] = out[key][: HEAD_DIM // 2]
    if _is_int(out.get("original_max_position_embeddings")):
        out["original_max_position_embeddings"] = min(out["original_max_position_embeddings"], POSITIONS // 4)
    return out


def _scale_to_sum(parts: list[int], total: int) -> list[int]:
    scaled = [max(1, p * total // sum(parts)) for p in parts]
    scaled[-1] += total - sum(scaled)
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
    if _is_int(old.get("moe_layer_end_index")):
        new["moe_layer_end_index"] = -1 if old["moe_layer_end_index"] < 0 else MIN_LAYERS - 1


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
    per_layer = {k: v for k, v in old.items() if isinstance(v, list) and len(v) == n and n > 1
                 and k not in INDEX_LISTS and not _is_token_key(k) and k != "architectures"}
    index = {k: [i % n for i in old[k] if _is_int(i)] for k in INDEX_LISTS if isinstance(old.get(k), list)}
    cycle = max((len(old[k]) for k in CYCLES if isinstance(old.get(k), list)), default=0)
    keep = _select(n, per_layer, index, max(MIN_LAYERS, cycle))
    for key in counts:
        new[key] = min(old[key], len(keep)) if key != counts[0] else len(keep)
        new[key] = max(new[key], 1)
    for key, values in per_layer.items():
        new[key] = [values[i] for i in keep]
    for key, indices in index.items():
        new[key] = [j for j, i in enumerate(keep) if i in indices]


def _select(n: int, per_layer: dict[str, list[Any]], index: dict[str, list[int]], least: int) -> list[int]:
    """Greedy: layer i joins when it shows a (list, value) or (index list, member?) pair not seen yet."""
    seen: set[tuple[str, str]] = set()
    keep: list[int] = []
    for i in range(n):
        kinds = {(k, json.dumps(v[i], sort_keys=True, default=str)) for k, v in per_layer.items()}
        kinds |= {(k, str(i in v)) for k, v in index.items()}
        if kinds - seen:
            keep.append(i)
            seen |= kinds
    extra = [i for i in range(n) if i not in keep]
    return sorted(keep + extra[: max(0, min(least, n) - len(keep))])


RULES: tuple[Rule, ...] = (_sizes, _heads, _rotary, _mla, _moe, _ssm, _linear_attention, _layers)


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
        sub = getattr(cfg, key, None)
        if isinstance(sub, PretrainedConfig) and isinstance(value, dict):
            out[key] = type(sub)(**{**_customised(sub), **_materialise(sub, value)})
    return out


def _customised(cfg: Any) -> dict[str, Any]:
    """The fields of ``cfg`` that differ from its class defaults (what a parent config set on it)."""
    try:
        default = vars(type(cfg)())
    except Exception:  # a class without defaults: keep everything
        default = {}
    return {k: v for k, v in vars(cfg).items() if not k.startswith("_") and default.get(k, object()) != v
            and k not in ("transformers_version", "architectures")}


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
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
