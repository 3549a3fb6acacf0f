"""Checks before a ``Session`` adopts a state, or keeps one: the state must belong to the model.

A state from a file, a store or a caller must come from this model (fingerprint), on its
device and dtype, in its layer layout, with contents that mean something on it (hostile inputs);
and the model's weights must not have changed under a state made with them. Each check
raises a typed error that shows the expected value, the value found, and the fix.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from .adapters.binding import Binding
from .adapters.fingerprinting import fingerprint as fingerprint_of
from .adapters.fingerprinting import mismatch
from .errors import (
    DeviceMismatchError,
    DtypeMismatchError,
    FingerprintMismatchError,
    InputError,
    LayoutMismatchError,
)
from .identity import Fingerprint
from .state import State


def check_session_args(tokenizer: object = None, state: object = None, caches: tuple[object, ...] = ()) -> None:
    """``Session(model, tokenizer=, state=, store=, sources=)`` takes a tokenizer (or None), a ``State`` (or None)
    and prefix caches (``lookup`` and ``offer``: a ``PrefixStore``, a pool); anything else is a typed error here,
    not an AttributeError later (or, for a cache, a warning on every call)."""
    for cache in caches:
        if not (callable(getattr(cache, "lookup", None)) and callable(getattr(cache, "offer", None))):
            raise InputError("store and sources must be prefix caches", expected="a PrefixStore (or an object with "
                             "lookup and offer)", found=type(cache).__name__,
                             fix=f"pass store=PrefixStore({cache!r})" if isinstance(cache, str) else
                             "pass store=kvstate.PrefixStore(folder or redis URL)")
    if tokenizer is not None and not callable(getattr(tokenizer, "get_vocab", None)):
        raise InputError("tokenizer must be the model's tokenizer", expected="a transformers tokenizer or None",
                         found=type(tokenizer).__name__, fix="pass AutoTokenizer.from_pretrained(...), or omit it")
    if state is not None and not isinstance(state, State):
        raise InputError("state must be a kvstate State", expected="a State or None", found=type(state).__name__,
                         fix="pass session.state, or kvstate.load_state(path)")


def context_length(model: torch.nn.Module) -> int | None:
    """The positions a model has where it cannot go past them: a learned position table (an embedding other than
    the input one with as many rows as its config's ``max_position_embeddings`` / ``n_positions`` / ``n_ctx``;
    GPT-2 and its kin), past whose rows a forward fails. None otherwise: rotary models run past their trained
    length, as plain ``generate`` lets them (transformers warns)."""
    config = model.config.get_text_config(decoder=True)
    sizes = {v for v in (getattr(config, n, None) for n in ("max_position_embeddings", "n_positions", "n_ctx"))
             if isinstance(v, int) and v > 0}
    tokens = model.get_input_embeddings()
    tables = [m.num_embeddings for m in model.modules()
              if isinstance(m, torch.nn.Embedding) and m is not tokens and m.num_embeddings in sizes]
    return min(tables) if tables else None


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
    well-formed and still fail these (hostile inputs)."""
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
        fields = [difference.split(":")[0] for difference in differences]
        raise FingerprintMismatchError(
            f"state belongs to a different model ({', '.join(fields[:4])}{', ...' if len(fields) > 4 else ''} "
            f"differ{'s' if len(fields) == 1 else ''})", expected=f"model fingerprint {fingerprint.to_dict()}",
            found="; ".join(differences), fix="load the model the state was made with, or start a fresh Session")


def adopt(binding: Binding, fingerprint: Fingerprint, state: State, vocab: int) -> State:
    """``state`` if a session on ``binding.model`` with ``fingerprint`` may continue it; else a typed error."""
    model = binding.model
    param = next(model.parameters())
    check_model(state, fingerprint, model, param.dtype, param.device)
    binding.layout.check(state)
    check_contents(state, vocab, logits_width(model), binding.layout)
    return state


def check_weights(model: torch.nn.Module, fingerprint: Fingerprint, state: State) -> Fingerprint:
    """The fingerprint to keep: ``fingerprint`` while the weights are unchanged, the new one if they changed
    under an empty ``state``; a typed error if they changed under a state made with the old weights.

    Cheap when nothing changed: fingerprints are cached per model, keyed by every tensor's version counter.
    """
    current = fingerprint_of(model)
    if current.weights_digest == fingerprint.weights_digest:
        return fingerprint
    if not state.is_empty:
        raise FingerprintMismatchError(
            "the model's weights changed after this session's state was made",
            expected=f"weights_digest {fingerprint.weights_digest}", found=f"weights_digest {current.weights_digest}",
            fix="reset() to start over on the new weights, or restore the weights the state was made with")
    return replace(current, tokenizer_hash=fingerprint.tokenizer_hash)
