"""Validation of everything a caller hands a ``Session``, done once per call, before anything runs.

``validate`` turns a ``Session.generate`` call into a frozen ``Request``: the history
``ids`` ``[B, L]`` (a private int64 copy), its bool ``mask`` ``[B, L]``, the family's
media inputs for the whole history, the media ``spans`` and content hashes, the
resolved generation options, the compression budget if any, and the ``PrefixQuery``
sources key the history by. ``validate_extension`` does the same for ``Session.extend``.
Every broken rule raises a typed error that shows what was expected, what was found
and the fix; planning and the engine never re-check (core v3).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from .adapters.binding import Binding
from .compress.during import Budget, plan_rounds, split_options
from .errors import (
    BatchMismatchError,
    EmptyStateError,
    InputError,
    MaskError,
    PlaceholderError,
    PositionError,
    RollbackError,
    UnsupportedError,
)
from .identity import Fingerprint
from .options import GenerateOptions, check_sequence_bias, check_stop_strings, resolve
from .protocols import PrefixQuery
from .state import MediaItem, State

IdsLike = torch.Tensor | Sequence[int] | Sequence[Sequence[int]]


@dataclass(frozen=True)
class Feed:
    """New tokens for the model: ``ids`` ``[B, Q]``, ``mask`` ``[B, T + Q]`` over processed + new
    slots, their ``positions`` ``[B, Q(, R)]``, the model inputs that belong to them (pixels), and
    the media ``spans`` ``[start, end)`` among them, as absolute slots (never split by a chunk)."""

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    inputs: Mapping[str, torch.Tensor]
    spans: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, eq=False)
class Request:
    """A validated ``generate`` call (see the module docstring).

    ``media`` is None for batches, or when the pixels given do not cover every item
    (then a resume trusts the placeholders); ``query`` is None when no prefix source
    can serve the history (a batch, padding, unknown media).
    """

    ids: torch.Tensor
    mask: torch.Tensor
    inputs: Mapping[str, torch.Tensor]
    spans: tuple[tuple[int, int], ...]
    media: tuple[MediaItem, ...] | None
    options: GenerateOptions
    budget: Budget | None
    query: PrefixQuery | None

    @property
    def batch_size(self) -> int:
        return int(self.ids.shape[0])


def validate(binding: Binding, fingerprint: Fingerprint, input_ids: IdsLike, attention_mask: torch.Tensor | None,
             kwargs: dict[str, object], *, device: torch.device, vocab_size: int) -> Request:
    """The ``Request`` of ``Session.generate(input_ids, attention_mask, **kwargs)``; ``kwargs`` is consumed."""
    budget = split_options(kwargs)
    keys = binding.inputs.keys
    inputs = {k: kwargs.pop(k) for k in keys if k in kwargs}
    refuse_media(kwargs, keys, binding.caps.name)
    options = resolve(binding.model, kwargs)
    ids = as_ids(input_ids, device, vocab_size)
    check_placeholders(binding, ids, inputs)
    check_length(options, ids.shape[1])
    mask = history_mask(ids, attention_mask, options.pad_id)
    check_padding(binding, mask)
    spans = tuple(binding.inputs.spans(ids, inputs))
    media = media_items(binding, ids, inputs, spans)
    if budget is not None:
        budget = _check_budget(budget, options, mask)
    check_sequence_bias(options.config, vocab_size)
    check_stop_strings(options.config.stop_strings, options.kwargs.get("tokenizer"))
    query = None
    if ids.shape[0] == 1 and bool(mask.all()) and media is not None:
        query = PrefixQuery(fingerprint, ids.cpu(), tuple((m.start, m.digest) for m in media))
    return Request(ids, mask, MappingProxyType(inputs), spans, media, options, budget, query)  # type: ignore[arg-type]


@dataclass(frozen=True, eq=False)
class Extension:
    """A validated ``Session.extend`` call on a state of ``T`` slots: ``ids`` ``[B, Q]`` new tokens,
    ``mask`` ``[B, T + Q]`` over processed + new slots, ``positions`` the model's positions for the new
    tokens, the family's media ``inputs``, their ``spans`` (absolute slots) and ``media`` items."""

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    inputs: Mapping[str, torch.Tensor]
    spans: tuple[tuple[int, int], ...]
    media: tuple[MediaItem, ...] | None

    @property
    def feed(self) -> Feed:
        """What the engine feeds: the new tokens with their mask, positions, inputs and media spans."""
        return Feed(self.ids, self.mask, self.positions, self.inputs, self.spans)


def validate_extension(binding: Binding, state: State, ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor | None, inputs: dict[str, Any]) -> Extension:
    """The ``Extension`` of ``Session.extend(ids, attention_mask, position_ids=, **inputs)`` after ``state``;
    ``ids`` ``[B, Q]`` come from ``as_ids``."""
    inputs = model_inputs(inputs, binding.inputs.keys, binding.caps.name)
    check_batch(state, ids.shape[0])
    if ids.shape[1] == 0:
        raise InputError("extend needs at least one new token", expected="Q >= 1", found=0)
    T = state.tokens_seen
    mask = full_mask(state, T + ids.shape[1], attention_mask, ids.device)
    check_padding(binding, mask)
    check_placeholders(binding, ids, inputs)
    binding.inputs.check(ids, inputs, 0)
    own_spans = binding.inputs.spans(ids, inputs)  # relative to the new tokens
    positions = binding.inputs.positions(state.next_position, ids, mask[:, T:], inputs)
    check_positions(state, position_ids, binding.inputs.model_positions(positions), mask[:, T:])
    media = media_items(binding, ids, inputs, own_spans, offset=T)
    spans = tuple((a + T, b + T) for a, b in own_spans)
    return Extension(ids, mask, positions, MappingProxyType(inputs), spans, media)


def validate_truncate(binding: Binding, state: State, n_tokens: object) -> int:
    """The token count of ``Session.truncate(n_tokens)``; a typed error for a non-int, or a family that
    cannot roll back (``State.truncated`` checks the range and each layer)."""
    try:
        n = None if isinstance(n_tokens, bool) else operator.index(n_tokens)  # type: ignore[call-overload]
    except TypeError:
        n = None
    if n is None:
        raise InputError("truncate takes a token count", expected="int", found=repr(n_tokens),
                         fix="pass an int between 0 and state.tokens_seen")
    if not binding.caps.rollback and n != state.tokens_seen:
        raise RollbackError(f"{binding.caps.name} models cannot roll back exactly",
                            expected="a model whose state is all in the cache",
                            found="the self-check found state outside the cache", fix="reset() and re-feed")
    return n


def check_padding(binding: Binding, mask: torch.Tensor) -> None:
    """Families whose state cannot hold padded rows refuse a padded mask."""
    if not binding.caps.padding and not bool(mask.all()):
        raise UnsupportedError(f"padded batches are not supported for {binding.caps.name} models",
                               found="padding: attention_mask zeros, or pad_token_id in a history given without "
                               "a mask (generate masks those)",
                               fix="run one row per Session; to keep pad ids as tokens, pass "
                               "attention_mask=torch.ones_like(input_ids)")


def check_placeholders(binding: Binding, ids: torch.Tensor, inputs: Mapping[str, Any]) -> None:
    """Refuse media placeholder ids outside every processor-made item of ``ids`` ``[B, L]`` when the
    call passes that kind's pixels. ``generate`` reads a generated ``<|image_pad|>`` as text, but any
    forward with pixels counts it as an image token and fails, cold or warm: no run of such a history
    is the cold answer, so none is made."""
    for strays in binding.inputs.strays(ids):
        if inputs.get(strays.pixels_key) is None:  # without pixels the ids are text to every path
            continue
        kind, token, n = strays.kind, strays.token, len(strays.slots)
        where = [s for _, s in strays.slots] if ids.shape[0] == 1 else [f"row {b} slot {s}" for b, s in strays.slots]
        ids_text = f"{n} {kind} placeholder id{'s' if n > 1 else ''} ({token})"
        raise PlaceholderError(
            f"{ids_text} outside every {kind} the processor laid out, in a call with {kind} pixels: transformers "
            f"would count {'them' if n > 1 else 'it'} as {kind} tokens",
            expected=f"id {token} only inside the {kind}s' placeholder runs, which {strays.pixels_key} fill",
            found=f"{ids_text} at slot{'s' if n > 1 else ''} {where[:8]}{' ...' if n > 8 else ''}, as a model "
            "generates them",
            fix=f"strip id {token} from the history before passing the {kind}s again, and keep it out of generated "
            f"text with generate(..., suppress_tokens=[{token}]) or bad_words_ids=[[{token}]]")


def media_items(binding: Binding, ids: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                spans: Sequence[tuple[int, int]], offset: int = 0) -> tuple[MediaItem, ...] | None:
    """The media items of ``ids`` ``[1, Q]`` (their ``spans``; slots shifted by ``offset``) with their
    content hashes; None for batches, or when the pixels given do not cover every item."""
    if ids.shape[0] != 1:
        return None
    hashes = binding.inputs.hashes(ids, inputs)
    if hashes is None:
        return None
    ends = dict(spans)
    return tuple(MediaItem(offset + start, offset + ends[start], digest) for start, digest in hashes)


def _check_budget(budget: Budget, options: GenerateOptions, mask: torch.Tensor) -> Budget:
    budget = plan_rounds(budget, options)
    if mask.shape[0] != 1 or not bool(mask.all()):
        raise UnsupportedError("generate(compress=...) decodes one row without padding",
                               found=f"batch of {mask.shape[0]}, padding: {not bool(mask.all())}",
                               fix="run one row per Session, unpadded")
    return budget


def check_model_object(model: torch.nn.Module) -> None:
    """A transformers model, not in training mode with dropout (every forward would be random)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise InputError("Session takes a loaded transformers model", expected="a PreTrainedModel (torch.nn.Module "
                         "with a config)", found=type(model).__name__,
                         fix="pass AutoModelForCausalLM.from_pretrained(...) or kvstate.testing.tiny_model(...)")
    if model.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        raise InputError("the model is in training mode, with dropout active", expected="model.eval()",
                         found="model.training = True and dropout p > 0", fix="call model.eval() first")


def check_settings(**settings: int | None) -> None:
    rules = {"chunk_size": 1, "canonical_chunk": 0, "sliding_reserve": 0, "max_checkpoints": 0,
             "checkpoint_every": 1, "prefill_rows": 0}
    for name, value in settings.items():
        if value is None and name == "checkpoint_every":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < rules[name]:
            least = f"{name}=0 (off) or more" if rules[name] == 0 else f"{name}=1 or more"
            raise InputError(f"invalid Session setting {name}", expected=f"int >= {rules[name]}",
                             found=repr(value)[:40], fix=f"pass {least}")


def brief(values: torch.Tensor, n: int = 8) -> object:
    """A tensor for an error message: its values when few, else its shape and first ``n`` values."""
    if values.numel() <= n:
        return values.tolist()
    return f"shape {list(values.shape)}, starting {values.flatten()[:n].tolist()} ..."


def mask_difference(expected: torch.Tensor, found: torch.Tensor) -> str:
    """Where two bool masks ``[B, T]`` differ, in a line: how many slots, and the first few (row, slot, value)."""
    where = torch.nonzero(expected.cpu() != found.cpu())
    first = ", ".join(f"row {b} slot {t}: {int(found[b, t])} (state: {int(expected[b, t])})"
                      for b, t in where[:3].tolist())
    return f"{len(where)} of {expected.numel()} slots differ; {first}{', ...' if len(where) > 3 else ''}"


def check_given(settings: object, kind: type, keywords: Mapping[str, object],
                defaults: Mapping[str, object]) -> Any:
    """``settings=`` (an instance of ``kind``) given instead of the setting keywords, which stay at ``defaults``."""
    if not isinstance(settings, kind):
        raise InputError("settings= takes a kvstate.settings.Settings", expected=kind.__name__,
                         found=type(settings).__name__, fix="pass kvstate.settings.Settings(...), or the keywords")
    given = sorted(k for k, v in keywords.items() if v != defaults[k])
    if given:
        raise InputError("pass either settings= or the setting keywords", expected="one of the two",
                         found=f"settings= and {given}", fix="put those values into the Settings")
    return settings


def check_many(sessions: Sequence[tuple[object, object]], n_ids: int) -> None:
    """``Session.extend_many``: sessions (as ``(model, settings)``) of one model and settings, one ids each."""
    if any(m is not sessions[0][0] or s != sessions[0][1] for m, s in sessions) or n_ids != len(sessions):
        raise InputError("extend_many takes sessions of one model and settings, one ids each",
                         expected=f"{len(sessions)} ids for sessions of one model and settings",
                         found=f"{n_ids} ids", fix="group the sessions by model and settings")


def check_marks(marks: object) -> tuple[int, ...]:
    """``canonical_marks``: turn marks (1 to 64 token ids), line marks (``kvstate.schedule.lines``), prompt marks
    (``kvstate.schedule.prompt``) or none, as a tuple."""
    from .schedule import valid_marks

    ok = isinstance(marks, Sequence | torch.Tensor) and not isinstance(marks, str | bytes)
    values = (marks.reshape(-1).tolist() if isinstance(marks, torch.Tensor) else list(marks)) if ok else []
    if not ok or not valid_marks(values):
        raise InputError("invalid Session setting canonical_marks",
                         expected="a sequence of 0 to 64 token ids, line marks (kvstate.schedule.lines) or prompt "
                                  "marks (kvstate.schedule.prompt)",
                         found=repr(marks)[:120],
                         fix="pass kvstate.text.turn_marks(tokenizer), kvstate.text.line_marks(tokenizer), "
                             "kvstate.text.PromptMarks(tokenizer, gap)(prompt_ids), or ()")
    return tuple(values)


def check_through(through: IdsLike, device: torch.device, vocab: int) -> torch.Tensor:
    """``settle(through=...)``: one history's ids, as ``[L]``."""
    ids = as_ids(through, device, vocab)
    if ids.shape[0] != 1:
        raise InputError("settle(through=...) takes one history", expected="ids [L] or [1, L]",
                         found=f"shape {tuple(ids.shape)}", fix="settle one conversation at a time")
    return ids[0]


def check_length(options: GenerateOptions, length: int) -> None:
    """A history of ``length`` tokens must hold a token to continue, and leave room for one new token
    (``model.generate``'s rule, typed)."""
    if length == 0:
        raise InputError("generate needs a history to continue", expected="input_ids [B, L] with L >= 1",
                         found="an empty history", fix="pass at least one token (a BOS for an empty prompt)")
    if options.max_length is not None and length >= options.max_length:
        raise InputError("the history already reaches max_length", expected=f"len(input_ids) < {options.max_length}",
                         found=f"{length} tokens", fix="set max_new_tokens (preferred) or a larger max_length")


def as_ids(input_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]], device: torch.device,
           vocab_size: int) -> torch.Tensor:
    """``input_ids`` as a fresh int64 ``[B, L]`` tensor on ``device`` (never the caller's memory)."""
    try:
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise InputError("input_ids must be token ids", expected="int tensor [B, L] or nested lists of ints",
                         found=f"{type(input_ids).__name__}: {str(exc)[:120]}",
                         fix="pass tokenizer(..., return_tensors='pt').input_ids") from exc
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise InputError("input_ids must be token ids", expected="int tensor [B, L]",
                         found=f"{ids.dtype} tensor of shape {tuple(ids.shape)} on {ids.device}",
                         fix="pass tokenizer(..., return_tensors='pt').input_ids")
    if ids.is_meta:
        raise InputError("input_ids hold no data", expected="token ids on a real device", found="a meta tensor",
                         fix="pass ids on the CPU or the model's device")
    if ids.shape[0] == 0:
        raise InputError("input_ids hold no row", expected="[B, L] with B >= 1", found=f"shape {tuple(ids.shape)}",
                         fix="pass at least one sequence")
    ids = ids.to(device=device, dtype=torch.long, copy=True)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise InputError("token id out of the vocabulary", expected=f"0 <= id < {vocab_size}",
                         found=f"ids from {int(ids.min())} to {int(ids.max())}",
                         fix="encode with this model's tokenizer")
    return ids


def history_mask(ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_id: int | None = None) -> torch.Tensor:
    """The bool mask ``[B, L]`` of a full history (a fresh copy).

    With no mask, ``model.generate``'s own default: ids equal to ``pad_id`` are padding
    (``options.GenerateOptions.pad_id`` says when generate infers that); else all ones.
    """
    if attention_mask is None:
        return check_mask_values(torch.ones_like(ids, dtype=torch.bool) if pad_id is None else ids != pad_id)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(ids.shape):
        raise MaskError("attention_mask must match input_ids", expected=tuple(ids.shape),
                        found=tuple(getattr(attention_mask, "shape", ())) or type(attention_mask).__name__,
                        fix="pass the full-history mask")
    return check_mask_values(attention_mask).to(device=ids.device, dtype=torch.bool, copy=True)


def check_mask_values(mask: torch.Tensor) -> torch.Tensor:
    """A mask ``[B, L]`` holds only 0 and 1 (or bools), and every row attends to something; returns ``mask``."""
    if mask.is_meta or mask.is_complex():
        raise MaskError("attention_mask must hold 0 and 1", expected="a bool or int tensor",
                        found=f"{mask.dtype} tensor on {mask.device}", fix="pass tokenizer(...).attention_mask")
    odd = mask[(mask != 0) & (mask != 1)] if mask.dtype != torch.bool else mask[:0]
    if odd.numel():  # transformers would read 0.5 as "attend": a value that is neither is a caller's bug
        raise MaskError("attention_mask must hold only 0 and 1", expected="0 (padding) or 1 (a token)",
                        found=f"{mask.dtype} mask with values such as {odd[:4].tolist()}",
                        fix="pass tokenizer(...).attention_mask, or a bool tensor")
    empty = torch.nonzero(~mask.bool().any(dim=-1)).flatten() if mask.shape[-1] else mask.new_zeros(0)
    if empty.numel():
        raise MaskError("an attention_mask row has no token to attend to", expected="at least one 1 per row",
                        found=f"all-zero rows {empty[:8].tolist()}",
                        fix="give each row a real token (without an attention_mask, ids equal to "
                        "pad_token_id are padding, as in generate)")
    return mask


# Inputs that carry media (or per-slot media semantics) for transformers' multimodal models.
MEDIA_KEYS = frozenset({
    "pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "image_sizes", "pixel_attention_mask",
    "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask", "token_type_ids", "input_features",
    "input_features_mask", "image_position_ids", "second_per_grid_ts",
})


def refuse_media(keys: Any, allowed: tuple[str, ...], family: str) -> None:
    """Media inputs a family's adapter does not hold are refused before anything runs (media state)."""
    media = sorted(k for k in keys if k in MEDIA_KEYS and k not in allowed)
    if media:
        raise UnsupportedError(
            f"{family} models: kvstate holds their text state only", expected="token ids (and attention_mask)",
            found=f"media inputs {media}", fix="media state (paligemma's prefix-LM mask, mllama's "
            "cross-attention K/V, llava's image features) needs a family adapter; Qwen2-VL, Qwen2.5-VL, "
            "Qwen3-VL and Gemma 3 have one. Run text-only, or see docs/coverage.md")


def model_inputs(inputs: dict[str, Any], allowed: tuple[str, ...], family: str) -> dict[str, Any]:
    """The extra model inputs a family takes (e.g. pixels); anything else is a typed error."""
    refuse_media(inputs, allowed, family)
    unknown = sorted(set(inputs) - set(allowed))
    if unknown:
        raise InputError(f"unknown model inputs for {family} models", expected=list(allowed) or "none",
                         found=unknown, fix="pass only token ids, attention_mask and the family's media inputs")
    return dict(inputs)


def check_batch(state: State, batch_size: int) -> None:
    if not state.is_empty and state.batch_size != batch_size:
        raise BatchMismatchError("input batch differs from the state's batch",
                                 expected=state.batch_size, found=batch_size,
                                 fix="pass one row per state row, or reset() / fork() first")


def full_mask(state: State, n_total: int, attention_mask: torch.Tensor | None,
              device: torch.device) -> torch.Tensor:
    """The bool mask ``[B, n_total]`` over processed + new slots.

    ``None`` means "no padding in the new slots". A given mask must cover processed +
    new tokens, and agree with the state on the processed part.
    """
    B, T = state.batch_size, state.tokens_seen
    if attention_mask is None:
        new = torch.ones(B, n_total - T, dtype=torch.bool, device=device)
        return torch.cat([state.mask, new], dim=1)
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, n_total):
        raise MaskError("attention_mask must cover processed + new tokens",
                        expected=f"shape ({B}, {n_total}) = processed {T} + new {n_total - T}",
                        found=tuple(getattr(attention_mask, "shape", ())) or type(attention_mask).__name__,
                        fix="pass the full-length mask, as with a transformers cache")
    mask = check_mask_values(attention_mask).to(device=device, dtype=torch.bool, copy=True)
    if not torch.equal(mask[:, :T], state.mask):
        raise MaskError("attention_mask disagrees with the processed tokens' padding",
                        expected="the state's own mask over its processed slots (session.state.mask)",
                        found=mask_difference(state.mask, mask[:, :T]),
                        fix="reuse the mask the state was built with (session.state.mask)")
    return mask


def check_positions(state: State, given: torch.Tensor | None, expected: torch.Tensor,
                    new_mask: torch.Tensor) -> None:
    """A caller's ``position_ids`` must equal the ones that continue the state (model layout)."""
    if given is None:
        return
    given = given.to(expected.device).long()
    real = new_mask if expected.dim() == 2 else new_mask.expand(expected.shape[0], *new_mask.shape)
    if given.shape == expected.shape and torch.equal(given[real], expected[real]):
        return
    if state.is_empty:
        raise EmptyStateError(
            "position_ids continue a sequence, but the state is empty",
            expected=brief(expected), found=brief(given),
            fix="feed the earlier tokens first, or omit position_ids")
    raise PositionError("position_ids do not continue the state", expected=brief(expected),
                        found=brief(given), fix="omit position_ids, or pass state.next_position + offsets")
