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

Stop strings are bounded (``MAX_STOP_STRINGS`` of at most ``MAX_STOP_CHARS`` characters each, with a
``tokenizer=``): transformers' ``StopStringCriteria`` builds a table of vocabulary x stop length (one int32 column
of the whole vocabulary per character, 1 MiB on a 262k vocabulary), so a 12,000-character stop string asks for
12 GiB. Options transformers refuses when ``generate`` starts (``GenerationConfig.validate``, its logits
processors) are refused there, before any forward, as ``GenerationOptionError`` (still a ``ValueError``).

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
from .errors import GenerationOptionError, InputError, UnsupportedError

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
MAX_STOP_STRINGS = 16  # stop_strings per call (module docstring: the table transformers builds for them)
MAX_STOP_CHARS = 64  # characters per stop string


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


def check_stop_strings(stops: Any, tokenizer: Any) -> None:
    """``stop_strings`` (a string or a list of them, from the call or a generation config) within kvstate's bounds,
    with the tokenizer ``generate`` needs to match them (``GenerationOptionError`` otherwise)."""
    if stops is None:
        return
    strings = [stops] if isinstance(stops, str) else stops
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) and s for s in strings):
        raise GenerationOptionError("stop_strings must be a non-empty string or a list of them",
                                    found=repr(stops)[:80], fix="pass stop_strings=['\\n\\n'], say")
    longest = max((len(s) for s in strings), default=0)
    if len(strings) > MAX_STOP_STRINGS or longest > MAX_STOP_CHARS:
        raise GenerationOptionError(
            "too many or too long stop_strings: transformers matches them with a table of vocabulary x length",
            expected=f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters",
            found=f"{len(strings)} strings, the longest {longest} characters",
            fix="stop on a shorter string (its last characters usually suffice), or pass your own "
            "transformers.StopStringCriteria(tokenizer, strings) in stopping_criteria= (kvstate does not bound it)")
    if tokenizer is None:
        raise GenerationOptionError("stop_strings need the tokenizer, to match them to tokens",
                                    found="stop_strings without tokenizer=",
                                    fix="pass tokenizer=AutoTokenizer.from_pretrained(...) with stop_strings, as "
                                    "model.generate needs it")


def check_sequence_bias(config: Any, vocab_size: int) -> None:
    """``sequence_bias`` token ids inside the vocabulary: transformers checks them only at the first decode step."""
    bias = config.sequence_bias
    pairs = bias.items() if isinstance(bias, dict) else bias or ()
    try:
        ids = sorted({int(t) for sequence, _ in pairs for t in sequence})
    except (TypeError, ValueError):
        return  # a malformed bias: transformers' own check at generate's entry names it
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        raise GenerationOptionError("sequence_bias names tokens outside the vocabulary",
                                    expected=f"token ids in [0, {vocab_size})", found=outside[:8],
                                    fix="bias only ids the tokenizer produces")


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
