"""Generation options: resolved exactly as ``model.generate`` resolves them, checked before anything runs.

``Session.generate`` hands the caller's options to ``model.generate`` unchanged,
with the full history, so logits processors, stopping criteria, streamers,
sampling defaults and return values behave as on the plain path. What cannot hold
with a resumed state is refused here, with ``UnsupportedError``, before the state
or the model is touched:

* several sequences per row (beam search, ``num_return_sequences > 1``): one state
  holds one sequence per row (fork per sample instead);
* assisted / DoLa / contrastive decoding, classifier-free guidance and token
  healing: they run the model on inputs kvstate does not track, or rewrite the prompt;
* another cache (``cache_implementation``): the state is the cache;
* attention maps and hidden states: the reused slots' were never recomputed.

Options are set through keywords, a ``generation_config=``, or the model's own
``generation_config``; all three count, because the config is resolved as
``generate`` resolves it.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ._compat.generation import prepare_generation_config
from .errors import InputError, UnsupportedError

# generate() parameters that are not generation-config fields; they pass through unchanged.
PASS_THROUGH = ("generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
                "streamer", "synced_gpus", "tokenizer")
# Keywords kvstate sets itself: the caller's history, mask and state say the same thing.
OWNED = ("input_ids", "inputs", "attention_mask", "position_ids", "cache", "past_key_values", "inputs_embeds",
         "cache_position")
_REFUSED_ARGS = {
    "assistant_model": "assisted decoding runs a second model on tokens kvstate does not track",
    "assistant_tokenizer": "assisted decoding runs a second model on tokens kvstate does not track",
    "negative_prompt_ids": "classifier-free guidance runs the model on an unconditional prompt",
    "negative_prompt_attention_mask": "classifier-free guidance runs the model on an unconditional prompt",
    "custom_generate": "a custom decoding loop may call the model outside the state",
}
_MODES = ("greedy_search", "sample")


@dataclass(frozen=True)
class GenerateOptions:
    """Validated options for one ``generate`` call.

    ``kwargs`` go to ``model.generate`` unchanged; ``return_dict`` says whether it
    returns an output object; ``prefill_chunk_size`` (if set) chunks kvstate's own
    feed of the unprocessed suffix; ``config`` is the ``GenerationConfig`` they resolve to.
    """

    kwargs: Mapping[str, Any]
    return_dict: bool
    prefill_chunk_size: int | None
    config: Any = None
    max_length: float | None = None
    pad_id: int | None = None


def resolve(model: torch.nn.Module, kwargs: dict[str, Any]) -> GenerateOptions:
    """Check ``kwargs`` (generation options only; media inputs already removed)."""
    for key in kwargs:
        if key in OWNED:
            raise InputError(f"generate() sets {key!r} itself", found=key,
                             fix="pass the full history (and its attention_mask) positionally; kvstate assigns "
                             "positions and supplies the cache from the state")
        if key in _REFUSED_ARGS:
            raise UnsupportedError(f"{key} is not supported: {_REFUSED_ARGS[key]}", found=key,
                                   fix=f"call model.generate directly for {key}")
    config_kwargs = {k: v for k, v in kwargs.items() if k not in PASS_THROUGH}
    try:
        config, model_kwargs = prepare_generation_config(model, kwargs.get("generation_config"),
                                                                 config_kwargs)
    except (TypeError, ValueError, AttributeError) as exc:
        raise InputError("invalid generation options", found=f"{type(exc).__name__}: {exc}",
                         fix="pass a transformers GenerationConfig or generation keywords") from exc
    unknown = sorted(k for k in model_kwargs if k not in ("output_attentions", "output_hidden_states"))
    if unknown:
        raise InputError("unknown generate() options", expected="GenerationConfig fields or generate() arguments",
                         found=unknown, fix="check the spelling; model inputs such as pixel_values must belong "
                         "to the model family")
    _check_config(config)
    # use_cache=False only makes plain generate recompute every step; the tokens are the same, and the
    # state is the cache, so kvstate keeps it on (whether it came from the call or model.generation_config)
    return GenerateOptions(MappingProxyType({**kwargs, "use_cache": True}), bool(config.return_dict_in_generate),
                           config.prefill_chunk_size, config, _max_length(model, kwargs, config),
                           _pad_id(model, config))


def _pad_id(model: torch.nn.Module, config: Any) -> int | None:
    """The id ``generate`` masks in a history given without ``attention_mask`` (None: none). Mirrors
    transformers' ``_prepare_attention_mask_for_generation``: the pad id, unless it is unset, also an
    EOS id, or the model's forward takes no mask (xLSTM)."""
    if "attention_mask" not in inspect.signature(model.forward).parameters:
        return None
    try:
        eos = set() if config.eos_token_id is None else set(torch.as_tensor(config.eos_token_id).flatten().tolist())
        pad = None if config.pad_token_id is None else operator.index(config.pad_token_id)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InputError("pad_token_id and eos_token_id must be token ids", expected="an int (eos: or a list)",
                         found=f"pad {config.pad_token_id!r}, eos {config.eos_token_id!r}"[:120],
                         fix="pass ints, or leave them to model.generation_config") from exc
    return None if pad is None or pad in eos else pad


def _max_length(model: torch.nn.Module, kwargs: dict[str, Any], config: Any) -> int | None:
    """The total length ``generate`` will refuse a history to reach (None: no limit). Mirrors
    transformers' ``_prepare_generated_length`` and ``_validate_generated_length``: ``max_new_tokens``
    wins; a ``max_length`` nobody set becomes 20 new tokens, capped at ``max_position_embeddings``."""
    if config.max_new_tokens is not None:
        return None
    given = kwargs.get("generation_config")
    default = (kwargs.get("max_length") is None and (given is None or given.max_length is None)
               and model.generation_config.max_length is None)  # type: ignore[union-attr]
    if default:
        limit = getattr(model.config, "max_position_embeddings", None)
        return limit if isinstance(limit, int) else None
    if isinstance(config.max_length, bool) or not isinstance(config.max_length, (int, float)):
        raise InputError("max_length must be a number", expected="an int", found=repr(config.max_length)[:40],
                         fix="pass max_new_tokens=N (preferred) or max_length=N")
    return config.max_length


def end_ids(config: Any) -> frozenset[int]:
    """The end-of-sequence ids of a generation config (``eos_token_id``: None, an id or a list of ids)."""
    eos = getattr(config, "eos_token_id", None)
    return frozenset() if eos is None else frozenset(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def _check_config(config: Any) -> None:
    mode = str(config.get_generation_mode().value)
    refusals = {
        "several sequences per row (beam search or num_return_sequences > 1)":
            config.num_beams > 1 or (config.num_return_sequences or 1) > 1,
        f"decoding mode {mode!r}": mode not in _MODES,
        "classifier-free guidance (guidance_scale)": config.guidance_scale not in (None, 1, 1.0),
        "token healing (it rewrites the processed prompt)": bool(config.token_healing),
        "another cache (cache_implementation)": config.cache_implementation is not None,
        "attention maps or hidden states (reused slots were never recomputed)":
            bool(config.output_attentions or config.output_hidden_states),
    }
    refused = [what for what, hit in refusals.items() if hit]
    if refused:
        raise UnsupportedError("generation option not supported with a resumed state: " + "; ".join(refused),
                               expected="greedy or sampled decoding of one sequence per row", found=refused,
                               fix="fork() the session per sample, or call model.generate directly for this option")
