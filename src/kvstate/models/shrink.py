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

What the rules cannot express is in small tables in ``shrink_rules``, one line of reason per entry:
``OVERRIDES`` (applied last), ``BASE`` (defaults that do not validate), ``CODE_MROPE`` (rope sections the
modeling code assumes). Types that
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
from .shrink_rules import (
    BASE,
    CAP,
    CAUSAL_FLAGS,
    CODE_MROPE,
    CYCLES,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INDEX_LISTS,
    KEEP_IDS_BELOW,
    KV_HEADS,
    LAYER_COUNTS,
    MAX_LAYERS,
    MIN_LAYERS,
    OVERRIDES,
    POSITIONS,
    Q_HEADS,
    RATIO,
    SET,
    TOKEN_ID_SUFFIXES,
    TOKEN_IDS,
    TOP_K,
    UNBUILDABLE,
    VOCAB,
)


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
