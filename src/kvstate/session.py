"""``Session``: one explicit ``State`` for one loaded transformers model.

Every verb takes the same walk (``docs/architecture.md``):

1. **validate** the caller's ids, masks, options and media, copying what it keeps;
2. **plan** with pure code (``kvstate.resume``): which prefix of the state to keep;
3. **run** the model through the ``Engine``, which returns a new ``State``;
4. **commit** that state with one assignment.

States are immutable and the engine never changes the one it is given, so an
exception at any step, ``KeyboardInterrupt`` included, leaves ``session.state``
exactly as it was. A prefix store is read before planning and offered the new
state just before the commit; a store that fails costs a warning, never the answer. ``fork`` is O(1):
forks share tensors until one of them moves on, and nothing writes in place.
"""

from __future__ import annotations

import copy
import operator
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from . import resume
from .engine import Engine, FeedSettings, Generated
from .errors import (
    FingerprintMismatchError,
    InputError,
    LayoutMismatchError,
    RollbackError,
    StoreWarning,
    UnsupportedError,
)
from .fingerprint import Fingerprint, fingerprint
from .inputs import (
    as_ids,
    check_batch,
    check_contents,
    check_model,
    check_positions,
    check_session_args,
    full_mask,
    history_mask,
    logits_width,
    model_inputs,
    refuse_media,
)
from .options import check_length, resolve
from .protocols import PrefixCache, PrefixQuery
from .resume import ResumePlan
from .selfcheck import adapter_for, vocab_size
from .state import MediaItem, State

IdsLike = torch.Tensor | Sequence[int] | Sequence[Sequence[int]]


class Session:
    """Owns the generation state of one conversation batch on one model.

    Args:
        model: a transformers causal LM whose family kvstate supports.
        tokenizer: optional; only hashed into the state's fingerprint.
        chunk_size: longest run of tokens fed in one forward.
        sliding_reserve: extra slots each sliding-window layer keeps beyond its
            window, so the state can roll back that many tokens (memory: reserve x
            sliding layers x K/V bytes per token).
        max_checkpoints: snapshots of non-croppable (recurrent) layers kept for rollback;
            the oldest is evicted first. Taken at the end of every call.
        checkpoint_every: also checkpoint every N tokens inside long feeds.
        store: a ``kvstate.PrefixStore`` (any ``kvstate.protocols.PrefixCache``);
            ``generate`` starts from the longest stored prefix of its history and
            writes prefixes back.
        state: start from this state instead of an empty one (checked against the model).

    A session is used by one thread at a time; sessions that share a model may run
    in different threads (the engine serializes their runs on that model).
    """

    def __init__(self, model: torch.nn.Module, *, tokenizer: object | None = None,
                 chunk_size: int = 512, sliding_reserve: int = 64, max_checkpoints: int = 16,
                 checkpoint_every: int | None = None, store: PrefixCache | None = None,
                 state: State | None = None, _fingerprint: Fingerprint | None = None) -> None:
        check_session_args(model, tokenizer, state)
        _check_settings(chunk_size=chunk_size, sliding_reserve=sliding_reserve, max_checkpoints=max_checkpoints,
                        checkpoint_every=checkpoint_every)
        _check_inference_mode(model)
        self.model = model
        self._adapter = adapter_for(model)
        self._engine = Engine(model, self._adapter)
        self.chunk_size, self.sliding_reserve = chunk_size, sliding_reserve
        self.max_checkpoints, self.checkpoint_every = max_checkpoints, checkpoint_every
        self.store = store
        self._fingerprint = _fingerprint or fingerprint(model, tokenizer)
        self.last_plan: ResumePlan | None = None
        self._state = self._empty(1) if state is None else self._adopt(state)
        if store is not None and checkpoint_every is None and any(x.checkpointed for x in self._state.layers):
            self.checkpoint_every = store.chunk_tokens  # stored prefixes of recurrent families need checkpoints

    # ----- read-only views -------------------------------------------------------------
    @property
    def state(self) -> State:
        """The current state. Its tensors are shared with forks and files: treat them as
        read-only (``state.clone()`` gives a private copy)."""
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
        """Measured cost of the last prefill-sized forward on this model, per token (0 until measured)."""
        return self._engine.seconds_per_token

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ----- state verbs -----------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything: outputs then equal a freshly loaded model's."""
        self._engine.reset_model()
        self._fingerprint = replace(fingerprint(self.model), tokenizer_hash=self._fingerprint.tokenizer_hash)
        self._commit(self._empty(1))

    def fork(self) -> Session:
        """An independent session on the same model, starting from this state. O(1)."""
        twin = copy.copy(self)  # same model, so the adoption checks would be redundant
        twin.last_plan = None
        return twin

    def truncate(self, n_tokens: int) -> None:
        """Roll back to the first ``n_tokens`` slots; ``RollbackError`` if a layer cannot."""
        try:
            n = operator.index(n_tokens)
        except TypeError:
            n = None
        if n is None or isinstance(n_tokens, bool):
            raise InputError("truncate takes a token count", expected="int", found=repr(n_tokens),
                             fix="pass an int between 0 and state.tokens_seen")
        if not self._adapter.caps.rollback and n != self._state.tokens_seen:
            raise RollbackError(f"{self._adapter.caps.name} models cannot roll back exactly",
                                expected="a model whose state is all in the cache",
                                found="the self-check found state outside the cache", fix="reset() and re-feed")
        self._commit(self._state.truncated(n))

    def compress(self, policy: Any, *, query_ids: IdsLike | None = None, sliding: str = "window",
                 budget: int | None = None) -> None:
        """Evict slots from the attention layers with ``policy`` (see ``kvstate.compress``).

        Retained slots keep their original logical positions, new tokens continue at the
        true next position, and each layer gets its own mask from then on, so the
        continuation is exactly "attention restricted to the retained slots".

        Args:
            policy: e.g. ``KVzip(0.5)``; ``ratio`` is the fraction of slots to evict.
            query_ids: ``[B, Q]`` the question that will follow, for question-aware
                selection: attention-based policies score with the question's attention
                instead of their question-agnostic watch. The question is not fed.
            sliding: ``"window"`` (each layer evicts ``ratio`` of its slots; sliding layers
                compress within their window) or ``"context"`` (kvpress's meaning: every
                layer keeps at most ``(1 - ratio) * tokens_seen`` slots).
            budget: keep at most this many slots per attention layer instead of ``ratio``.
        """
        from .compress.apply import compress_state

        self._check_weights()
        query = None if query_ids is None else self._ids(query_ids)
        if query is not None:
            check_batch(self._state, query.shape[0])
        self._commit(compress_state(self._engine, self.model, self._state, policy, query_ids=query, sliding=sliding,
                                    budget=budget))

    # ----- files -------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None,
             compact: str | None = None) -> int:
        """Write the state to one crash-safe file (see ``kvstate.save_state``); returns bytes."""
        from .io import save_state

        return save_state(self._state, path, metadata=metadata, compact=compact)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: torch.nn.Module, *, cast_dtype: bool = False,
             tokenizer: object | None = None, chunk_size: int = 512) -> Session:
        """A session on ``model`` continuing the state saved at ``path``.

        The state is checked against the model (fingerprint, layers, heads, dtype) and
        moved to the model's device. ``cast_dtype=True`` opts in to casting a state of
        another dtype; the cast is recorded in ``state.metadata``.
        """
        from .io import load_state

        check_session_args(model, tokenizer)
        param = next(model.parameters())
        state = load_state(path, map_location=param.device, dtype=param.dtype if cast_dtype else None)
        reserve = max((int(layer.meta().get("reserve") or 0) for layer in state.layers), default=0)
        return cls(model, tokenizer=tokenizer, chunk_size=chunk_size, sliding_reserve=reserve, state=state)

    # ----- feeding tokens --------------------------------------------------------------
    def extend(self, input_ids: IdsLike, attention_mask: torch.Tensor | None = None, *,
               position_ids: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        """Process new tokens and return the last position's logits ``[B, V]`` (a fresh tensor).

        Args:
            input_ids: ``[B, Q]`` new (unprocessed) token ids.
            attention_mask: ``[B, T + Q]`` over processed + new slots, or None for no
                padding in the new slots.
            position_ids: optional ``[B, Q]``; must equal the positions that continue
                the state (checked), since kvstate assigns them itself.
            inputs: the family's media inputs for these tokens (e.g. ``pixel_values``).
        """
        inputs = model_inputs(inputs, self._adapter.caps.input_keys, self._adapter.caps.name)
        self._check_weights()
        ids = self._ids(input_ids)
        state = self._state_for_batch(ids.shape[0])
        if ids.shape[1] == 0:
            raise InputError("extend needs at least one new token", expected="Q >= 1", found=0)
        mask = full_mask(state, state.tokens_seen + ids.shape[1], attention_mask, self.device)
        self._check_padding(mask)
        self._adapter.check_inputs(self.model, ids, inputs, 0)
        feed = self._engine.feed_for(state, ids, mask, inputs)
        new_mask = mask[:, state.tokens_seen:]
        check_positions(state, position_ids, self._adapter.model_positions(feed.positions), new_mask)
        new = self._engine.feed(state, feed, self._settings()).with_checkpoint(self.max_checkpoints)
        media = self._media(ids, inputs, self._adapter.media_spans(self.model, ids, inputs), offset=state.tokens_seen)
        self._commit(_with_media(new, state, media))
        return new.last_logits.clone()  # type: ignore[union-attr]

    def generate(self, input_ids: IdsLike, attention_mask: torch.Tensor | None = None,
                 **generate_kwargs: Any) -> Any:
        """Continue the *full* history ``input_ids`` ``[B, L]``, like ``model.generate``.

        Every generation option behaves as in ``model.generate(input_ids, **options)``
        (see ``kvstate.options`` for the few that are refused, before anything runs).
        Reuses the longest processed prefix, rolls back where the layers allow (else
        resumes from a checkpoint, else re-feeds from scratch), feeds only the
        unprocessed suffix, and returns the new token ids ``[B, N]``. With
        ``return_dict_in_generate=True`` the transformers output object is returned,
        its ``sequences`` holding only the new tokens (the state holds the cache).

        ``compress=policy, budget=B, every=N`` decodes on at most ``B`` slots per attention
        layer: every ``N`` new tokens the state is compressed to ``B - N`` slots
        (``kvstate.compress.during``); the prompt is fed whole first.
        """
        from .compress.during import split_options

        budgeted = split_options(generate_kwargs)
        inputs = {k: generate_kwargs.pop(k) for k in self._adapter.caps.input_keys if k in generate_kwargs}
        refuse_media(generate_kwargs, self._adapter.caps.input_keys, self._adapter.caps.name)
        options = resolve(self.model, generate_kwargs)
        self._check_weights()
        ids = self._ids(input_ids)
        state = self._state_for_batch(ids.shape[0])
        check_length(options, ids.shape[1])
        mask = history_mask(ids, attention_mask, options.pad_id)
        self._check_padding(mask)
        spans = self._adapter.media_spans(self.model, ids, inputs)
        media = self._media(ids, inputs, spans)
        query = self._query(ids, mask, media)
        plan, base = self._plan(state, ids, mask, spans, query, media)
        self._adapter.check_inputs(self.model, ids, inputs, plan.reused)
        start = resume.start_state(base, plan, self._empty(ids.shape[0]))
        feed = None
        if plan.fed:
            T = start.tokens_seen
            feed = self._engine.feed_for(start, ids[:, T:], mask,
                                         self._adapter.select_inputs(self.model, ids, T, inputs))
        if budgeted is not None:
            return self._generate_within(start, feed, ids, mask, options, budgeted, media)
        generated = self._engine.generate(start, feed, ids, mask, options, self._settings())
        new = _with_media(generated.state.with_checkpoint(self.max_checkpoints), start, media)
        if query is not None:  # before the commit: a Ctrl-C while writing leaves the session as it was
            # the prompt (what a repeated request can reuse) and the conversation (what the next turn can)
            self._offer((_with_media(generated.prefilled, start, media), new), query)
        self._commit(new, plan)
        return _answer(generated, options.return_dict)

    # ----- internals ---------------------------------------------------------------------
    def _generate_within(self, start: State, feed: Any, ids: torch.Tensor, mask: torch.Tensor, options: Any,
                         budgeted: tuple[Any, int, int], media: tuple[MediaItem, ...] | None) -> torch.Tensor:
        """``generate`` in rounds under a slot budget (``kvstate.compress.during``); one commit at the end.
        The prefix store is not offered the result: a compressed state is not the prompt's cache."""
        from .compress.apply import compress_state
        from .compress.during import generate_within, plan_rounds

        policy, budget, every = budgeted
        total, ends = plan_rounds(options, ids.shape[1])
        if ids.shape[0] != 1 or not bool(mask.all()):
            raise UnsupportedError("generate(compress=...) decodes one row without padding",
                                   found=f"batch of {ids.shape[0]}, padding: {not bool(mask.all())}",
                                   fix="run one row per Session, unpadded")
        settings = self._settings()
        prefilled = start if feed is None else self._engine.feed(start, feed, settings)

        def one_more(state: State, token: torch.Tensor) -> State:
            ones = torch.ones(1, state.tokens_seen + 1, dtype=torch.bool, device=self.device)
            return self._engine.feed(state, self._engine.feed_for(state, token, ones, {}), settings)

        state, new = generate_within(
            prefilled, ids, options, budget=budget, every=every, total=total, ends=ends,
            compress=lambda st, b: compress_state(self._engine, self.model, st, policy, budget=b),
            generate=lambda st, h, o: self._engine.generate(st, None, h, torch.ones_like(h, dtype=torch.bool), o,
                                                            settings),
            feed=one_more)
        self._commit(_with_media(state.with_checkpoint(self.max_checkpoints), start, media))
        return new

    def _commit(self, state: State, plan: ResumePlan | None = None) -> None:
        """The only place the session's state changes."""
        self._state, self.last_plan = state, plan if plan is not None else self.last_plan

    def _check_weights(self) -> None:
        """The model still has the weights the state was made with; an in-place edit since is noticed.

        Cheap when nothing changed: ``fingerprint`` is cached per model, keyed by every
        tensor's version counter.
        """
        current = fingerprint(self.model)
        if current.weights_digest == self._fingerprint.weights_digest:
            return
        current = replace(current, tokenizer_hash=self._fingerprint.tokenizer_hash)
        if not self._state.is_empty:
            raise FingerprintMismatchError(
                "the model's weights changed after this session's state was made",
                expected=f"weights_digest {self._fingerprint.weights_digest}",
                found=f"weights_digest {current.weights_digest}",
                fix="reset() to start over on the new weights, or restore the weights the state was made with")
        self._fingerprint = current

    def _settings(self) -> FeedSettings:
        return FeedSettings(self.chunk_size, self.checkpoint_every, self.max_checkpoints)

    def _ids(self, input_ids: IdsLike) -> torch.Tensor:
        return as_ids(input_ids, self.device, vocab_size(self.model))

    def _plan(self, state: State, ids: torch.Tensor, mask: torch.Tensor, spans: Any,
              query: PrefixQuery | None, media: tuple[MediaItem, ...] | None) -> tuple[ResumePlan, State]:
        """The best plan over the session's state and, if it helps, the longest stored prefix."""
        rollback = self._adapter.caps.rollback
        own = resume.plan(state, ids, mask, spans, rollback=rollback, media=media)
        stored = None if query is None else self._lookup(query, longer_than=own.reused, at_most=ids.shape[1] - 1)
        if stored is None:
            return own, state
        theirs = resume.plan(stored, ids, mask, spans, source="store", rollback=rollback, media=media)
        chosen = resume.best([own, theirs])
        return chosen, stored if chosen is theirs else state

    def _media(self, ids: torch.Tensor, inputs: dict[str, Any], spans: Sequence[tuple[int, int]],
               offset: int = 0) -> tuple[MediaItem, ...] | None:
        """The media items of ``ids`` ``[1, Q]`` (their ``spans``; slots shifted by ``offset``) with their
        content hashes; None for batches, or when the pixels given do not cover every item."""
        if ids.shape[0] != 1:
            return None
        hashes = self._adapter.media_hashes(self.model, ids, inputs)
        if hashes is None:
            return None
        ends = dict(spans)
        return tuple(MediaItem(offset + start, offset + ends[start], digest) for start, digest in hashes)

    def _query(self, ids: torch.Tensor, mask: torch.Tensor,
               media: tuple[MediaItem, ...] | None) -> PrefixQuery | None:
        """What the store keys this history by; None without a store, or for batches and padding."""
        if self.store is None or ids.shape[0] != 1 or not bool(mask.all()) or media is None:
            return None
        return PrefixQuery(self._fingerprint, ids.cpu(), tuple((m.start, m.digest) for m in media))

    def _lookup(self, query: PrefixQuery, *, longer_than: int, at_most: int) -> State | None:
        try:
            stored = self.store.lookup(query, longer_than=longer_than, at_most=at_most)
            return None if stored is None else self._adopt(stored.to(self.device))
        except Exception as exc:  # a store is a cache: failing to read it is a miss
            warnings.warn(f"kvstate: prefix store read failed, continuing without it: {type(exc).__name__}: {exc}",
                          StoreWarning, stacklevel=3)
            return None

    def _offer(self, states: tuple[State, ...], query: PrefixQuery) -> None:
        try:
            self.store.offer(states, query, self._engine.seconds_per_token)
        except Exception as exc:  # the answer is already committed; never lose it to a cache
            warnings.warn(f"kvstate: prefix store write failed: {type(exc).__name__}: {exc}", StoreWarning,
                          stacklevel=3)

    def _empty(self, batch_size: int) -> State:
        return self._engine.empty(batch_size, self.sliding_reserve, self._fingerprint)

    def _check_padding(self, mask: torch.Tensor) -> None:
        if not self._adapter.caps.padding and not bool(mask.all()):
            raise UnsupportedError(f"padded batches are not supported for {self._adapter.caps.name} models",
                                   found="padding: attention_mask zeros, or pad_token_id in a history given "
                                   "without a mask (generate masks those)",
                                   fix="run one row per Session; to keep pad ids as tokens, pass "
                                   "attention_mask=torch.ones_like(input_ids)")

    def _adopt(self, state: State) -> State:
        check_model(state, self._fingerprint, self.model, self.dtype, self.device)
        expected = [(layer.kind, layer.meta().get("window")) for layer in self._empty(1).layers]
        found = [(layer.kind, layer.meta().get("window")) for layer in state.layers]
        if found != expected:
            raise LayoutMismatchError("state layers do not match the model's layers",
                                      expected=f"{len(expected)} layers {expected}",
                                      found=f"{len(found)} layers {found}",
                                      fix="load the state into the model it was made with")
        keyed = [(i, layer.tensors()) for i, layer in enumerate(state.layers) if "keys" in layer.tensors()]
        shapes = self._adapter.kv_shapes(self.model) if keyed else []
        for i, tensors in keyed:
            found = (tensors["keys"].shape[1], tensors["keys"].shape[3], tensors["values"].shape[3])
            if shapes[i] is not None and found != shapes[i]:
                raise LayoutMismatchError(f"layer {i} K/V head shape differs from the model's",
                                          expected=f"(kv_heads, key dim, value dim) = {shapes[i]}", found=found,
                                          fix="load the state into the model it was made with")
        check_contents(state, vocab_size(self.model), logits_width(self.model), shapes)
        return state

    def _state_for_batch(self, batch_size: int) -> State:
        state = self._state
        if state.is_empty and state.batch_size != batch_size:
            return self._empty(batch_size)
        check_batch(state, batch_size)
        return state


def _with_media(state: State, start: State, media: tuple[MediaItem, ...] | None) -> State:
    """``state`` (which continued ``start``) recording the items of ``media`` it processed."""
    new = tuple(m for m in media or () if m.start >= start.tokens_seen and m.end <= state.tokens_seen)
    return replace(state, media=(*start.media, *new)) if new else state


def _answer(generated: Generated, return_dict: bool) -> Any:
    """What ``generate`` returns: new ids ``[B, N]``, or the output object holding them."""
    return generated.output if return_dict else generated.tokens


def _check_inference_mode(model: torch.nn.Module) -> None:
    """Dropout that is active makes every forward random: no state can continue it exactly."""
    if model.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        raise InputError("the model is in training mode, with dropout active", expected="model.eval()",
                         found="model.training = True and dropout p > 0", fix="call model.eval() first")


def _check_settings(**settings: int | None) -> None:
    rules = {"chunk_size": 1, "sliding_reserve": 0, "max_checkpoints": 0, "checkpoint_every": 1}
    for name, value in settings.items():
        if value is None and name == "checkpoint_every":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < rules[name]:
            raise InputError(f"invalid Session setting {name}", expected=f"int >= {rules[name]}",
                             found=repr(value), fix=f"pass {name}={max(rules[name], 1)} or more")
