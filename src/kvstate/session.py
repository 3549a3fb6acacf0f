"""``Session``: one explicit ``State`` for one loaded transformers model.

Every call states its contract instead of guessing it: the processed tokens are in
``state.tokens``; new tokens always go in with a full-length mask and explicit
logical positions; a request's history is compared with the processed tokens, and
only the unprocessed suffix is fed. Two paths share the state:

* ``extend`` - a plain forward per chunk (and the manual decode loop, one token a call);
* ``generate`` - ``model.generate`` with a real transformers cache built from the state.

States are immutable, so ``fork`` is O(1) and forks can never see each other's tokens.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch

from . import _compat
from .adapters import adapter_for
from .compress.masks import layer_masks, needs_masks
from .errors import InputError, LayoutMismatchError, UnsupportedError
from .fingerprint import Fingerprint, fingerprint
from .generation import eos_ids, finished, rest_kwargs
from .inputs import as_ids, check_batch, check_model, check_positions, common_prefix, full_mask
from .layers import RecurrentLayerState
from .state import State, next_position_after

IdsLike = torch.Tensor | Sequence[int] | Sequence[Sequence[int]]


@dataclass(frozen=True)
class ResumePlan:
    """How the last ``generate`` call used the state.

    ``reused`` slots came from the state, ``fed`` slots went through the model before
    the first new token, and ``mode`` is one of ``continue``, ``rollback``,
    ``recompute`` (rollback impossible, so the history was re-fed from scratch) or
    ``stored-logits`` (history fully processed; first token from ``last_logits``).
    """

    reused: int
    fed: int
    mode: str


class Session:
    """Owns the generation state of one conversation batch on one model.

    Args:
        model: a transformers causal LM whose family kvstate supports.
        tokenizer: optional; only hashed into the state's fingerprint.
        chunk_size: longest run of tokens fed in one forward by ``extend``.
        sliding_reserve: extra slots each sliding-window layer keeps beyond its
            window, so the state can roll back that many tokens (memory: reserve x
            sliding layers x K/V bytes per token).
        max_checkpoints: snapshots of non-croppable (recurrent) layers kept for rollback;
            the oldest is evicted first. Each costs the recurrent layers' bytes
            (``state.summary()["checkpoint_nbytes"]``). Taken at the end of every call.
        checkpoint_every: also checkpoint every N tokens inside long ``extend`` calls.
        store: a ``kvstate.PrefixStore``; ``generate`` then starts from the longest stored
            prefix of its history and writes prefixes back (recurrent families checkpoint
            every ``store.chunk_tokens`` so that their prefixes are reusable).
        state: start from this state instead of an empty one (checked against the model).
    """

    def __init__(self, model: torch.nn.Module, *, tokenizer: object | None = None,
                 chunk_size: int = 512, sliding_reserve: int = 64, max_checkpoints: int = 16,
                 checkpoint_every: int | None = None, store: Any = None,
                 state: State | None = None, _fingerprint: Fingerprint | None = None) -> None:
        if chunk_size < 1 or sliding_reserve < 0:
            raise InputError("invalid Session settings", expected="chunk_size >= 1, sliding_reserve >= 0",
                             found={"chunk_size": chunk_size, "sliding_reserve": sliding_reserve})
        self.model = model
        self._adapter = adapter_for(model)
        self._config = self._adapter.text_config(model)
        self.chunk_size = chunk_size
        self.sliding_reserve = sliding_reserve
        self.max_checkpoints = max_checkpoints
        self.checkpoint_every = checkpoint_every
        self.store = store
        self._seconds_per_token = 0.0
        self._fingerprint = _fingerprint or fingerprint(model, tokenizer)
        self.last_plan: ResumePlan | None = None
        self._state = self._empty(1) if state is None else self._adopt(state)
        if store is not None and checkpoint_every is None and any(x.checkpointed for x in self._state.layers):
            self.checkpoint_every = store.chunk_tokens

    # ----- read-only views -------------------------------------------------------------
    @property
    def state(self) -> State:
        """The current state (immutable; tensors are shared, never written in place)."""
        return self._state

    @property
    def tokens(self) -> torch.Tensor:
        """Processed token ids ``[B, T]`` (a copy)."""
        return self._state.tokens.clone()

    @property
    def fingerprint(self) -> Fingerprint:
        return self._fingerprint

    @property
    def prefill_seconds_per_token(self) -> float:
        """Measured cost of the last prefill-dominated forward, per token (0 until measured)."""
        return self._seconds_per_token

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ----- state verbs -----------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything: outputs then equal a freshly loaded model's."""
        self._adapter.reset_model(self.model)
        self._state = self._empty(1)

    def fork(self) -> Session:
        """An independent session on the same model, starting from this state. O(1).

        States are immutable and kvstate never writes a tensor in place, so both
        sessions share tensors until one of them moves on.
        """
        twin = copy.copy(self)  # same model, so the adoption checks would be redundant
        twin.last_plan = None
        return twin

    def truncate(self, n_tokens: int) -> None:
        """Roll back to the first ``n_tokens`` slots; ``RollbackError`` if a layer cannot."""
        self._state = self._state.truncated(n_tokens)

    def compress(self, policy: Any) -> None:
        """Evict slots from the attention layers with ``policy`` (see ``kvstate.compress``).

        Retained slots keep their original logical positions, new tokens continue at the
        true next position, and each layer gets its own mask from then on, so the
        continuation is exactly "attention restricted to the retained slots".
        """
        from .compress.apply import compress_state

        self._state = compress_state(self.model, self._adapter, self._state, policy)

    # ----- files -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None,
             compact: str | None = None) -> int:
        """Write the state to one crash-safe file (see ``kvstate.save_state``); returns bytes."""
        return self._state.save(path, metadata=metadata, compact=compact)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: torch.nn.Module, *, cast_dtype: bool = False,
             tokenizer: object | None = None, chunk_size: int = 512) -> Session:
        """A session on ``model`` continuing the state saved at ``path``.

        The state is checked against the model (fingerprint, layers, heads, dtype) and
        moved to the model's device. ``cast_dtype=True`` opts in to casting a state of
        another dtype; the cast is recorded in ``state.metadata``.
        """
        from .files import load_state

        param = next(model.parameters())
        state = load_state(path, map_location=param.device, dtype=param.dtype if cast_dtype else None)
        reserve = max((int(layer.meta().get("reserve") or 0) for layer in state.layers), default=0)
        return cls(model, tokenizer=tokenizer, chunk_size=chunk_size, sliding_reserve=reserve, state=state)

    # ----- feeding tokens --------------------------------------------------------------
    def extend(self, input_ids: IdsLike, attention_mask: torch.Tensor | None = None, *,
               position_ids: torch.Tensor | None = None, **model_inputs: Any) -> torch.Tensor:
        """Process new tokens and return the last position's logits ``[B, V]``.

        Args:
            input_ids: ``[B, Q]`` new (unprocessed) token ids.
            attention_mask: ``[B, T + Q]`` over processed + new slots, or None for no
                padding in the new slots.
            position_ids: optional ``[B, Q]``; must equal the positions that continue
                the state (checked), since kvstate assigns them itself.
        """
        ids = as_ids(input_ids, self.device)
        state = self._state_for_batch(ids.shape[0])
        if ids.shape[1] == 0:
            raise InputError("extend needs at least one new token", expected="Q >= 1", found=0)
        mask = full_mask(state, state.tokens_seen + ids.shape[1], attention_mask, self.device)
        self._check_padding(mask)
        new_mask = mask[:, state.tokens_seen:]
        positions = self._adapter.chunk_positions(self.model, state.next_position, ids, new_mask, model_inputs)
        check_positions(state, position_ids, self._adapter.model_positions(positions), new_mask)
        self._state = self._feed(state, ids, mask, positions, model_inputs).with_checkpoint(self.max_checkpoints)
        assert self._state.last_logits is not None
        return self._state.last_logits

    def generate(self, input_ids: IdsLike, attention_mask: torch.Tensor | None = None,
                 **generate_kwargs: Any) -> Any:
        """Continue the *full* history ``input_ids`` ``[B, L]``, like ``model.generate``.

        Reuses the longest processed prefix, rolls back where the layers allow (else
        re-feeds from scratch), feeds only the unprocessed suffix, and returns the new
        token ids ``[B, N]``. With ``return_dict_in_generate=True`` the transformers
        output object is returned, its ``sequences`` holding only the new tokens.
        """
        if generate_kwargs.get("num_beams", 1) > 1 or generate_kwargs.get("num_return_sequences", 1) > 1:
            raise UnsupportedError("beam search and multiple return sequences keep one cache per "
                                   "beam", found=generate_kwargs, fix="use num_beams=1, or fork() "
                                   "per sample")
        inputs = {k: generate_kwargs.pop(k) for k in self._adapter.input_keys if k in generate_kwargs}
        ids = as_ids(input_ids, self.device)
        state = self._state_for_batch(ids.shape[0])
        mask = (torch.ones_like(ids, dtype=torch.bool) if attention_mask is None
                else attention_mask.to(self.device).bool())
        if mask.shape != ids.shape:
            raise InputError("attention_mask must match input_ids", expected=tuple(ids.shape),
                             found=tuple(mask.shape), fix="pass the full-history mask")
        self._check_padding(mask)
        media = self._adapter.media_hashes(self.model, ids, inputs) if self.store is not None else None
        if media is not None:
            state = self._from_store(state, ids, mask, media)
        self._state = self._resume_point(state, ids, mask)
        if self._state.tokens_seen == ids.shape[1]:
            out = self._from_stored_logits(ids, mask, generate_kwargs)
        else:
            inputs = self._adapter.select_inputs(self.model, ids, self._state.tokens_seen, inputs)
            self._pre_feed_stepwise(ids, mask, inputs)
            out = self._hf_generate(ids, mask, inputs, generate_kwargs)
        if media is not None:
            self.store.save(self, media)
        return out

    def _from_store(self, state: State, ids: torch.Tensor, mask: torch.Tensor, media: list) -> State:
        """The longest stored prefix of ``ids`` when it beats what the state already shares."""
        if ids.shape[0] != 1 or not bool(mask.all()):
            return state
        shared = common_prefix(state, ids, mask)
        stored = self.store.lookup(self, ids, media, longer_than=shared, at_most=ids.shape[1] - 1)
        if stored is None:
            return state
        return self._adopt(stored.to(self.device))

    # ----- internals ---------------------------------------------------------------------
    def _empty(self, batch_size: int) -> State:
        layers = self._adapter.empty_layers(self.model, self.sliding_reserve)
        return State.empty(layers, self._fingerprint, batch_size, self.device, self._adapter.position_dims)

    def _check_padding(self, mask: torch.Tensor) -> None:
        if not self._adapter.supports_padding and not bool(mask.all()):
            raise UnsupportedError(f"padded batches are not supported for {self._adapter.name} models",
                                   found="attention_mask with padding", fix="run one row per Session")

    def _adopt(self, state: State) -> State:
        check_model(state, self._fingerprint, self.dtype, self.device)
        expected = [(layer.kind, layer.meta().get("window")) for layer in self._empty(1).layers]
        found = [(layer.kind, layer.meta().get("window")) for layer in state.layers]
        if found != expected:
            raise LayoutMismatchError("state layers do not match the model's layers",
                                      expected=f"{len(expected)} layers {expected}",
                                      found=f"{len(found)} layers {found}",
                                      fix="load the state into the model it was made with")
        keyed = [(i, layer.tensors()["keys"]) for i, layer in enumerate(state.layers) if "keys" in layer.tensors()]
        heads, head_dim = self._adapter.kv_shape(self.model) if keyed else (0, 0)
        for i, keys in keyed:
            if (keys.shape[1], keys.shape[3]) != (heads, head_dim):
                raise LayoutMismatchError(f"layer {i} K/V head shape differs from the model's",
                                          expected=f"(kv_heads, head_dim) = {(heads, head_dim)}",
                                          found=(keys.shape[1], keys.shape[3]),
                                          fix="load the state into the model it was made with")
        return state

    def _state_for_batch(self, batch_size: int) -> State:
        state = self._state
        if state.is_empty and state.batch_size != batch_size:
            return self._empty(batch_size)
        check_batch(state, batch_size)
        return state

    def _feed(self, state: State, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
              model_inputs: dict[str, Any]) -> State:
        """Forward the new slots in chunks (one chunk when extra model inputs are given)."""
        T, Q, start = state.tokens_seen, ids.shape[1], 0
        while start < Q:
            end = min(start + self._chunk(state, Q - start, bool(model_inputs)), Q)
            state = self._forward(state, ids[:, start:end], mask[:, : T + end], positions[:, start:end],
                                  model_inputs)
            if self.checkpoint_every and end < Q and state.tokens_seen % self.checkpoint_every == 0:
                state = state.with_checkpoint(self.max_checkpoints)
            start = end
        return state

    def _chunk(self, state: State, remaining: int, whole: bool) -> int:
        """Tokens in the next forward: stepwise families continue one token at a time."""
        if self._adapter.stepwise_continuation and not state.is_empty:
            return 1
        size = remaining if whole else self.chunk_size
        if self.checkpoint_every:  # end chunks on checkpoint boundaries
            size = min(size, self.checkpoint_every - state.tokens_seen % self.checkpoint_every)
        return size

    def _forward(self, state: State, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 model_inputs: dict[str, Any]) -> State:
        cache = self._adapter.build_cache(self.model, state.layers, state.batch_size)
        self._adapter.restore_extras(self.model, dict(state.extras))
        kwargs = dict(model_inputs, input_ids=ids, attention_mask=_mask_arg(mask), use_cache=True,
                      logits_to_keep=1, **{_compat.CACHE_KWARG: cache})
        if self._adapter.takes_position_ids:
            kwargs["position_ids"] = self._adapter.model_positions(positions)
        start = time.perf_counter()
        with _masks(self.model, state, positions), torch.no_grad():
            out = self.model(**kwargs)
        self._note_prefill_speed(start, ids.shape[1])
        seen = state.tokens_seen + ids.shape[1]
        layers = self._adapter.read_cache(self.model, cache, state.layers, positions, seen)
        return self._next_state(state, ids, mask, positions, layers, out.logits[:, -1, :])

    def _note_prefill_speed(self, start: float, fed: int) -> None:
        """Remember the per-token cost of a prefill-dominated call (store statistics use it)."""
        if fed > 8:
            self._seconds_per_token = (time.perf_counter() - start) / fed

    def _next_state(self, state: State, fed: torch.Tensor, mask: torch.Tensor, fed_positions: torch.Tensor,
                    layers: tuple, logits: torch.Tensor | None) -> State:
        T, n = state.tokens_seen, state.tokens_seen + fed.shape[1]
        next_position = next_position_after(fed_positions, mask[:, T:n], state.next_position)
        extras = self._adapter.capture_extras(self.model, next_position, n)
        self._adapter.restore_extras(self.model, extras)  # the instance agrees with the state afterwards
        return replace(state, tokens=torch.cat([state.tokens, fed], dim=1), mask=mask[:, :n],
                       positions=torch.cat([state.positions, fed_positions], dim=1), layers=layers,
                       next_position=next_position, last_logits=logits, extras=MappingProxyType(extras),
                       fingerprint=self._fingerprint)

    def _resume_point(self, state: State, ids: torch.Tensor, mask: torch.Tensor) -> State:
        """The state cut back to what ``ids`` shares with it; records ``last_plan``."""
        T, L = state.tokens_seen, ids.shape[1]
        p = self._adapter.safe_prefix(self.model, ids, common_prefix(state, ids, mask))
        if p == T == L and state.last_logits is not None:
            self.last_plan = ResumePlan(reused=T, fed=0, mode="stored-logits")
            return state
        target = self._adapter.safe_prefix(self.model, ids, min(p, L - 1))  # feed at least one token
        if target == T:
            state, mode = state, "continue"
        elif not state.rollback_limit(target):
            uses_checkpoint = any(layer.rollback_limit(target) for layer in state.layers)
            state, mode = state.truncated(target), "checkpoint" if uses_checkpoint else "rollback"
        else:
            state, target, mode = self._from_checkpoint(state, target)
        self.last_plan = ResumePlan(reused=target, fed=L - target, mode=mode)
        return state

    def _from_checkpoint(self, state: State, target: int) -> tuple[State, int, str]:
        """Latest checkpoint at or before ``target`` that every layer can return to, else scratch."""
        for checkpoint in reversed(state.checkpoints):
            if checkpoint.tokens_seen <= target and not state.rollback_limit(checkpoint.tokens_seen):
                return state.truncated(checkpoint.tokens_seen), checkpoint.tokens_seen, "checkpoint"
        self._adapter.reset_model(self.model)
        return self._empty(state.batch_size), 0, "recompute"

    def _pre_feed_stepwise(self, ids: torch.Tensor, mask: torch.Tensor, inputs: dict[str, Any]) -> None:
        """Feed all but the last unprocessed token through ``_feed`` first, when that path is needed:
        stepwise families continue one token per forward, and checkpoints land on chunk boundaries."""
        state, L = self._state, ids.shape[1]
        stepwise = self._adapter.stepwise_continuation and not state.is_empty
        checkpoints = bool(self.checkpoint_every) and any(layer.checkpointed for layer in state.layers)
        if not (stepwise or checkpoints) or L - state.tokens_seen < 2:
            return
        T = state.tokens_seen
        positions = self._adapter.chunk_positions(self.model, state.next_position, ids[:, T:L - 1],
                                                  mask[:, T:L - 1], inputs)
        self._state = self._feed(state, ids[:, T:L - 1], mask[:, :L - 1], positions, inputs)

    def _hf_generate(self, ids: torch.Tensor, mask: torch.Tensor, inputs: dict[str, Any],
                     kwargs: dict[str, Any]) -> Any:
        """``model.generate`` over the unprocessed suffix; adopts the resulting state."""
        state, T = self._state, self._state.tokens_seen
        suffix_pos = self._adapter.chunk_positions(self.model, state.next_position, ids[:, T:], mask[:, T:], inputs)
        cache = self._adapter.build_cache(self.model, state.layers, state.batch_size)
        self._adapter.restore_extras(self.model, dict(state.extras))
        call = self._generate_inputs(state, ids, mask, suffix_pos)
        start = time.perf_counter()
        with _compat.capture_logits(self.model, T) as logits_at, _masks(self.model, state, suffix_pos), \
                torch.no_grad():
            out = self.model.generate(**call, **inputs, **{_compat.CACHE_KWARG: cache}, **kwargs)
        self._note_prefill_speed(start, ids.shape[1] - T)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        new_tokens = sequences[:, call["input_ids"].shape[1]:]
        self._state = self._after_generate(state, ids, mask, suffix_pos, new_tokens, cache, logits_at)
        if isinstance(out, torch.Tensor):
            return new_tokens
        out.sequences = new_tokens
        return out

    def _generate_inputs(self, state: State, ids: torch.Tensor, mask: torch.Tensor,
                         suffix_pos: torch.Tensor) -> dict[str, Any]:
        """Full history + full mask + explicit positions; generate slices the processed part."""
        if all(isinstance(layer, RecurrentLayerState) for layer in state.layers):
            return {"input_ids": ids[:, state.tokens_seen:]}  # pure-recurrent caches are not sliced
        # generate slices input_ids by the cache's slot count, which compression makes smaller than T
        call: dict[str, Any] = {"input_ids": ids[:, state.tokens_seen:] if needs_masks(state.layers) else ids,
                                "attention_mask": mask.long()}
        if self._adapter.takes_position_ids:
            positions = torch.cat([state.positions, suffix_pos], dim=1)
            call["position_ids"] = self._adapter.model_positions(positions)
        return call

    def _after_generate(self, state: State, ids: torch.Tensor, mask: torch.Tensor, suffix_pos: torch.Tensor,
                        new_tokens: torch.Tensor, cache: Any, logits_at: Any) -> State:
        """The state after generate: every fed slot, i.e. all but the last new token."""
        T, L, n_new = state.tokens_seen, ids.shape[1], new_tokens.shape[1]
        steps = torch.arange(1, n_new, device=ids.device)
        last = suffix_pos[:, -1:]  # generate continues each position component by +1
        gen_pos = last + (steps[None, :, None] if last.dim() == 3 else steps[None, :])
        fed_pos = torch.cat([suffix_pos, gen_pos], dim=1)
        full = torch.cat([mask, torch.ones_like(new_tokens[:, 1:], dtype=torch.bool)], dim=1)
        seen = L + n_new - 1
        layers = self._adapter.read_cache(self.model, cache, state.layers, fed_pos, seen)
        fed = torch.cat([ids[:, T:], new_tokens[:, :-1]], dim=1)
        return self._next_state(state, fed, full, fed_pos, layers, logits_at(seen)).with_checkpoint(
            self.max_checkpoints)

    def _from_stored_logits(self, ids: torch.Tensor, mask: torch.Tensor,
                            kwargs: dict[str, Any]) -> Any:
        """First token from ``last_logits`` (no re-feed), the rest through ``generate``."""
        config, _ = _compat.generation_config(self.model, dict(kwargs))
        if kwargs.get("return_dict_in_generate") or (ids.shape[0] > 1 and eos_ids(config)):
            return self._refeed_last(ids, mask, kwargs)  # per-row stops and logit outputs
        assert self._state.last_logits is not None
        first = _compat.first_token(self.model, config, ids, self._state.last_logits)[:, None]
        streamer = kwargs.get("streamer")
        if streamer is not None:
            streamer.put(ids.cpu())
            streamer.put(first[:, 0].cpu())
        if finished(config, first, ids.shape[1]):
            if streamer is not None:
                streamer.end()
            return first
        ones = torch.ones_like(first, dtype=torch.bool)
        rest = self._hf_generate(torch.cat([ids, first], 1), torch.cat([mask, ones], 1), {},
                                 rest_kwargs(kwargs, config, streamer))
        return torch.cat([first, rest], dim=1)

    def _refeed_last(self, ids: torch.Tensor, mask: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        """Fallback for the fully processed case: roll back one slot and let generate run."""
        L = ids.shape[1]
        target = self._adapter.safe_prefix(self.model, ids, L - 1)
        if self._state.rollback_limit(target):
            self._state, target, mode = self._from_checkpoint(self._state, target)
        else:
            self._state, mode = self._state.truncated(target), "rollback"
        self.last_plan = ResumePlan(reused=target, fed=L - target, mode=mode)
        self._pre_feed_stepwise(ids, mask, {})
        return self._hf_generate(ids, mask, {}, kwargs)


def _masks(model: torch.nn.Module, state: State, first: torch.Tensor) -> Any:
    """Per-layer masks while a compressed state is in use; nothing otherwise (bitwise the plain path)."""
    return layer_masks(model, state.layers, first) if needs_masks(state.layers) else nullcontext()


def _mask_arg(mask: torch.Tensor) -> torch.Tensor | None:
    """Drop an all-ones mask, as ``generate`` does, so both paths run the same kernels."""
    return None if bool(mask.all()) else mask.long()
