"""Validation of everything a caller hands to a ``Session``, done once per call.

Each check turns a broken resume contract into a typed error that shows the
expected value, the value found, and the fix. The per-token path never re-checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .adapters.fingerprinting import mismatch
from .errors import (
    BatchMismatchError,
    DeviceMismatchError,
    DtypeMismatchError,
    EmptyStateError,
    FingerprintMismatchError,
    InputError,
    LayoutMismatchError,
    MaskError,
    PositionError,
    UnsupportedError,
)
from .identity import Fingerprint
from .state import State


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
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8) or ids.is_meta:
        raise InputError("input_ids must be token ids", expected="int tensor [B, L]",
                         found=f"{ids.dtype} tensor of shape {tuple(ids.shape)} on {ids.device}",
                         fix="pass tokenizer(..., return_tensors='pt').input_ids")
    ids = ids.to(device=device, dtype=torch.long, copy=True)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise InputError("token id out of the vocabulary", expected=f"0 <= id < {vocab_size}",
                         found=f"ids from {int(ids.min())} to {int(ids.max())}",
                         fix="encode with this model's tokenizer")
    return ids


def check_session_args(tokenizer: object = None, state: object = None) -> None:
    """``Session(model, tokenizer=, state=)`` takes a tokenizer (or None) and a ``State`` (or None);
    anything else is a typed error here, not an AttributeError later."""
    if tokenizer is not None and not callable(getattr(tokenizer, "get_vocab", None)):
        raise InputError("tokenizer must be the model's tokenizer", expected="a transformers tokenizer or None",
                         found=type(tokenizer).__name__, fix="pass AutoTokenizer.from_pretrained(...), or omit it")
    if state is not None and not isinstance(state, State):
        raise InputError("state must be a kvstate State", expected="a State or None", found=type(state).__name__,
                         fix="pass session.state, or kvstate.load_state(path)")


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
    """Media inputs a family's adapter does not hold are refused before anything runs (issue 13)."""
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
                        expected=state.mask.int().tolist(), found=mask[:, :T].int().tolist(),
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
            "position_ids continue a sequence, but the state is empty (seed 002)",
            expected=expected.tolist(), found=given.tolist(),
            fix="feed the earlier tokens first, or omit position_ids")
    raise PositionError("position_ids do not continue the state", expected=expected.tolist(),
                        found=given.tolist(), fix="omit position_ids, or pass state.next_position + offsets")


def logits_width(model: torch.nn.Module) -> int:
    """The model's output size ``V`` (the LM head's rows; the config's vocab size without one)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    return int(model.config.get_text_config().vocab_size)  # type: ignore[union-attr,operator]


def check_contents(state: State, vocab: int, width: int, layout: Any) -> None:
    """What a state holds must mean something on this model: token ids in its vocabulary,
    ``last_logits`` ``[B, V]`` of its output size, and every checkpoint's K/V in its head layout
    ``layout.kv_shapes()`` ``(H, D_k, D_v)`` (``Layout.check`` covers the layers). A file can be
    well-formed and still fail these (issue 24)."""
    if state.tokens.numel() and (int(state.tokens.min()) < 0 or int(state.tokens.max()) >= vocab):
        raise LayoutMismatchError("the state's tokens are outside the model's vocabulary",
                                  expected=f"0 <= id < {vocab}",
                                  found=f"ids from {int(state.tokens.min())} to {int(state.tokens.max())}",
                                  fix="load the state into the model it was made with")
    last = state.last_logits
    if last is not None and (not last.is_floating_point() or last.shape[-1] != width):
        raise LayoutMismatchError("the state's last_logits do not fit the model's output",
                                  expected=f"floating [B, {width}]", found=f"{last.dtype} {tuple(last.shape)}",
                                  fix="load the state into the model it was made with")
    keyed = [(f"checkpoint {k} layer {i}", i, layer.tensors()) for k, c in enumerate(state.checkpoints)
             for i, layer in c.layers.items() if "keys" in layer.tensors()]
    shapes = layout.kv_shapes() if keyed else []
    for where, i, parts in keyed:
        found = (parts["keys"].shape[1], parts["keys"].shape[3], parts["values"].shape[3])
        if i < len(shapes) and shapes[i] is not None and found != shapes[i]:
            raise LayoutMismatchError(f"{where} K/V head shape differs from the model's",
                                      expected=f"(kv_heads, key dim, value dim) = {shapes[i]}", found=found,
                                      fix="load the state into the model it was made with")


def check_model(state: State, fingerprint: Fingerprint, model: torch.nn.Module, model_dtype: torch.dtype,
                device: torch.device) -> None:
    """Refuse a state stored on another device or dtype, or produced by another model."""
    if state.device.type != device.type:
        raise DeviceMismatchError("state and model are on different devices", expected=str(device),
                                  found=str(state.device), fix="pass state.to(model.device)")
    kv_dtype = state.kv_dtype
    if kv_dtype is not None and kv_dtype != model_dtype:
        made, model_name = str(kv_dtype).removeprefix("torch."), str(model_dtype).removeprefix("torch.")
        raise DtypeMismatchError(
            f"the state was made in {made} and the model runs in {model_name}", expected=model_name, found=made,
            fix=f"load the model in {made} (kvstate: --dtype {made}), or cast the state on purpose: "
            "Session.load(path, model, cast_dtype=True) (kvstate generate: --cast-state), or reset() and re-feed")
    differences = [] if state.fingerprint is None else \
        mismatch(state.fingerprint, model, fingerprint, cast="kvstate.cast" in state.metadata)
    if differences:
        raise FingerprintMismatchError(
            "state belongs to a different model", expected=f"model fingerprint {fingerprint.to_dict()}",
            found="; ".join(differences), fix="load the model the state was made with, or start a fresh Session")
