"""``Session``: one explicit ``State`` for one loaded transformers model.

Every verb takes the same walk (``docs/architecture.md``):

1. **validate** the caller's ids, masks, options and media (``kvstate.request``);
2. **plan** with pure code (``kvstate.resume``): which source's state to start from
   (the session's own first, then the server's pool or a prefix store) and which
   prefix of it to keep;
3. **run** the model through the ``Engine``, which returns a new ``State``;
4. **commit** that state with one assignment, after offering it to the sinks.

States are immutable and the engine never changes the one it is given, so an
exception at any step, ``KeyboardInterrupt`` included, leaves ``session.state``
exactly as it was. A source or sink that fails costs a warning, never the answer.
``fork`` is O(1): forks share tensors until one of them moves on, and nothing writes
in place. Under the canonical schedule (the default, ``kvstate.schedule``) every
warm answer equals the cold answer bit for bit.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from . import resume
from .adapters.fingerprinting import fingerprint
from .adopt import adopt, check_session_args, check_weights
from .engine import Engine, Feed, FeedSettings, Outcome
from .engine.prefill import tile_of
from .errors import InputError, StoreWarning
from .identity import Fingerprint
from .protocols import PrefixCache, StateSource
from .request import (
    IdsLike,
    Request,
    as_ids,
    check_batch,
    check_marks,
    check_model_object,
    check_settings,
    check_through,
    validate,
    validate_extension,
    validate_truncate,
)
from .resume import ResumePlan
from .schedule import POSITION_CHUNK, Canonical, default_chunk
from .selfcheck import bind, vocab_size
from .state import MediaItem, State

DEFAULT_CANONICAL_CHUNK = POSITION_CHUNK  # C without turn marks (kvstate.schedule.default_chunk)


class Session:
    """Owns the generation state of one conversation batch on one model.

    Args:
        model: a transformers causal LM whose family kvstate supports.
        tokenizer: optional; only hashed into the state's fingerprint.
        chunk_size: longest run of tokens fed in one forward when the canonical schedule is off.
        canonical_chunk: ``C``, tokens per canonical prefill chunk (``kvstate.schedule``): feeds are cut
            at multiples of ``C``, and a resume restarts from the last such cut it holds, so a warm
            answer is the cold answer bit for bit in every dtype. 0 turns it off (a resume then keeps
            the longest common prefix: exact within float32 rounding, not bitwise). Default
            (``None``): 64, or 256 with ``canonical_marks`` (``kvstate.schedule.default_chunk``).
        canonical_marks: token ids that start a conversation's turn (a chat template's user-turn
            prefix, ``kvstate.text.turn_marks(tokenizer)``): the cuts then also fall where each
            occurrence begins, with the chunks of ``C`` aligned to it, so a chat's next turn, once
            the answer is settled (``settle(through=...)``), feeds only its own tokens. Default none.
        sliding_reserve: extra slots each sliding-window layer keeps beyond its window and its
            last append (an answer is one), so the state can roll back that many tokens past
            where the append started (memory: reserve x sliding layers x K/V bytes per token).
            At least ``canonical_chunk - 1``: a canonical resume rolls back that far.
        max_checkpoints: snapshots of non-croppable (recurrent) layers kept for rollback;
            the oldest is evicted first. Taken at the end of every call and at canonical cuts.
        checkpoint_every: also checkpoint every N tokens inside long feeds.
        store: a ``kvstate.PrefixStore``: ``generate`` starts from the longest stored prefix of
            its history and writes prefixes back (the same as ``sources=[store]``).
        sources: more prefix caches after the session's own state and ``store`` (``PrefixCache``:
            the server's pool, another store); each is asked for prefixes and offered new states.
        state: start from this state instead of an empty one (checked against the model).
        prefill_rows: run prefill chunks as tiled forwards whose matrix products take this many rows at a
            time (``kvstate.engine.prefill``): the chunk computation a ``Scheduler`` with the same
            ``prefill_rows`` makes, alone or packed with other prompts, so its states continue here bit
            for bit (and this session's continue there). 0 (the default): plain forwards. States record
            the kernels (``State.canonical_device``); a resume reuses only slots of the same ones.

    A session is used by one thread at a time; sessions that share a model may run
    in different threads (the engine serializes their runs on that model).
    """

    def __init__(self, model: torch.nn.Module, *, tokenizer: object | None = None,
                 chunk_size: int = 512, canonical_chunk: int | None = None, sliding_reserve: int = 64,
                 max_checkpoints: int = 16, checkpoint_every: int | None = None, store: PrefixCache | None = None,
                 sources: Sequence[PrefixCache] = (), state: State | None = None,
                 canonical_marks: Sequence[int] = (), prefill_rows: int = 0, _prepack: bool = True,
                 _invariant: bool = True, _fingerprint: Fingerprint | None = None) -> None:
        marks = check_marks(canonical_marks)
        canonical_chunk = default_chunk(marks) if canonical_chunk is None else canonical_chunk
        check_settings(chunk_size=chunk_size, canonical_chunk=canonical_chunk, sliding_reserve=sliding_reserve,
                       max_checkpoints=max_checkpoints, checkpoint_every=checkpoint_every, prefill_rows=prefill_rows)
        check_model_object(model)
        check_session_args(tokenizer, state)
        self.model = model
        self._binding = bind(model)
        self._engine = Engine(self._binding)
        self.chunk_size, self.sliding_reserve = chunk_size, sliding_reserve
        # families that continue one token per forward cannot run the schedule (docs/exactness.md)
        self.canonical_chunk = 0 if self._binding.caps.stepwise else canonical_chunk
        self.canonical_marks = marks
        self.max_checkpoints, self.checkpoint_every = max_checkpoints, checkpoint_every
        self.prefill_rows, self._prepack, self._invariant = prefill_rows, _prepack, _invariant
        self.store = store  # may be replaced or set to None later; it is read on every call
        self.sources: tuple[PrefixCache, ...] = tuple(sources)
        self._fingerprint = _fingerprint or fingerprint(model, tokenizer)
        self.last_plan: ResumePlan | None = None
        self._state = self._empty(1) if state is None else self._adopt(state)

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
        self._commit(self._state.truncated(validate_truncate(self._binding, self._state, n_tokens)))

    def compress(self, policy: Any, *, query_ids: IdsLike | None = None, sliding: str = "window",
                 budget: int | None = None) -> None:
        """Evict slots from the attention layers with ``policy``, e.g. ``KVzip(0.5)`` (``kvstate.compress``:
        ``query_ids`` ``[B, Q]`` for question-aware scoring, ``sliding`` ``"window"`` or ``"context"``,
        ``budget`` slots per layer instead of the policy's ratio).

        Retained slots keep their logical positions and new tokens continue at the true next
        position, so the continuation is exactly "attention restricted to the retained slots".
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
             tokenizer: object | None = None, chunk_size: int = 512, canonical_chunk: int | None = None,
             canonical_marks: Sequence[int] | None = None, prefill_rows: int | None = None) -> Session:
        """A session on ``model`` continuing the state saved at ``path``.

        The state is checked against the model (fingerprint, layers, heads, dtype) and
        moved to the model's device. ``cast_dtype=True`` opts in to casting a state of
        another dtype; the cast is recorded in ``state.metadata``. ``canonical_chunk``
        , ``canonical_marks`` and ``prefill_rows`` default to the schedule the state was fed with, so its
        canonical slots stay reusable.
        """
        from .io import load_state

        check_model_object(model)
        param = next(model.parameters())
        state = load_state(path, map_location=param.device, dtype=param.dtype if cast_dtype else None)
        reserve = max((int(layer.meta().get("reserve") or 0) for layer in state.layers), default=0)
        marks = state.canonical_marks if canonical_marks is None else canonical_marks
        if canonical_chunk is None:
            canonical_chunk = state.canonical_chunk or None
        if prefill_rows is None:
            prefill_rows = tile_of(state.canonical_device)
        return cls(model, tokenizer=tokenizer, chunk_size=chunk_size, canonical_chunk=canonical_chunk,
                   sliding_reserve=reserve, state=state, canonical_marks=marks, prefill_rows=prefill_rows)

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

        Under the canonical schedule the new slots are canonical when the state ends at a cut
        (``generate`` then reuses them); otherwise they are fed in chunks of ``chunk_size``.
        """
        state, feed, media = self._extension(input_ids, attention_mask, position_ids, inputs)
        new = self._engine.feed(state, feed, self._settings())
        self._extended(state, new, media)
        return new.last_logits.clone()  # type: ignore[union-attr]

    @staticmethod
    def extend_many(sessions: Sequence[Session], input_ids: Sequence[IdsLike]) -> None:
        """``sessions[i].extend(input_ids[i])`` for every ``i`` (text ids ``[1, Q_i]``), the chunks of each
        round packed into one forward where the sessions' ``prefill_rows`` tile them: each session's state
        is bitwise what its own ``extend`` gives. The sessions share one model and their settings. Every
        input is checked before any forward; on a failure no session changes."""
        if not sessions:
            return
        first = sessions[0]
        if any(s.model is not first.model or s._settings() != first._settings() for s in sessions) or \
                len(input_ids) != len(sessions):
            raise InputError("extend_many takes sessions of one model and settings, one ids each",
                             expected=f"{len(sessions)} ids for sessions of one model and settings",
                             found=f"{len(input_ids)} ids", fix="group the sessions by model and settings")
        planned = [session._extension(given, None, None, {}) for session, given in zip(sessions, input_ids,
                                                                                         strict=True)]
        new = first._engine.feed_many([p[0] for p in planned], [p[1] for p in planned], first._settings())
        for session, (old, _, media), state in zip(sessions, planned, new, strict=True):
            session._extended(old, state, media)

    def generate(self, input_ids: IdsLike, attention_mask: torch.Tensor | None = None,
                 **generate_kwargs: Any) -> Any:
        """Continue the *full* history ``input_ids`` ``[B, L]``, like ``model.generate``.

        Every generation option behaves as in ``model.generate(input_ids, **options)``
        (see ``kvstate.options`` for the few that are refused, before anything runs).
        Reuses the longest processed prefix the canonical schedule allows, rolls back where
        the layers allow (else resumes from a checkpoint, else re-feeds from scratch), feeds
        only the rest, and returns the new token ids ``[B, N]``. With
        ``return_dict_in_generate=True`` the transformers output object is returned,
        its ``sequences`` holding only the new tokens (the state holds the cache). A ``streamer``
        that also has ``put_logits(logits)`` gets, before each put of new tokens, the raw logits
        ``[B, V]`` they were chosen from (live log-probabilities, as ``kvstate serve`` streams them).

        ``compress=policy, budget=B, every=N`` decodes on at most ``B`` slots per attention
        layer: every ``N`` new tokens the state is compressed to ``B - N`` slots
        (``kvstate.engine.budgeted``); the prompt is fed whole first.
        """
        return self.run(input_ids, attention_mask, **generate_kwargs).output

    def run(self, input_ids: IdsLike, attention_mask: torch.Tensor | None = None,
            **generate_kwargs: Any) -> Outcome:
        """``generate``, returning the whole ``Outcome``: new tokens, output, the slots reused and
        each row's ``finish_reason``."""
        request = self._validate(input_ids, attention_mask, generate_kwargs)
        plan = self._plan(request)
        outcome = self._engine.run(plan, request, self._settings())
        self._offer(outcome, request)
        self._commit(outcome.state, plan)
        return outcome

    def take_prefix(self, input_ids: IdsLike, attention_mask: torch.Tensor | None = None, **inputs: Any) -> int:
        """Make the state the longest prefix of the history ``input_ids`` ``[B, L]`` that ``run`` would
        reuse (from this state or a source), feeding nothing; returns its length in slots.

        For feeding a long history in pieces (``kvstate.batch`` interleaves them with decode steps):
        ``extend`` up to cuts of the canonical schedule, then ``run`` on the whole history. Each forward
        is one that a single ``run`` makes, and ``run`` reuses only canonical slots at a cut, so the
        answer is bitwise the single ``run``'s however the pieces went. ``inputs``: the history's media
        inputs (``pixel_values``...), as ``run`` takes them.
        """
        # planning needs no generation options; one new token keeps generate's length checks from refusing
        # a history that run, with its own max_new_tokens, accepts
        request = self._validate(input_ids, attention_mask, {"max_new_tokens": 1, **inputs})
        plan = self._plan(request)
        self._commit(plan.start, plan)  # type: ignore[arg-type]
        return plan.start.tokens_seen  # type: ignore[union-attr]

    def settle(self, through: IdsLike | None = None) -> int:
        """Recompute, in canonical chunks, the slots a resume would feed again: the decoded answer up to
        the state's last cut (issue 23). Returns how many slots were fed (0: nothing to do, or not
        possible: the schedule is off, a batch, padding, media in the way, or no rollback point).

        The state is then shorter (it ends at that cut) and every slot of it is canonical, so the next turn
        re-feeds at most the tail since the cut. It holds no logits: the output head is skipped (it costs
        the default model as much as the rest of a short forward), as the cold run skips it on a chunk that
        ends at a cut, and the next turn feeds on from there. A server runs this after a reply is sent, off
        the critical path. Transactional like every verb.

        ``through``: text ids ``[L]`` or ``[1, L]`` that the next turn's history begins with (the answer
        as the chat template renders it, closing tokens included) when a turn mark follows them
        (``canonical_marks``). The state is then fed up to ``L``: the next turn feeds only its own tokens.
        """
        state = self._state
        history = None if through is None else check_through(through, self.device, vocab_size(self.model))
        span = resume.settle_span(state, self._schedule(), history)
        if span is None:
            return 0
        start, end = span
        base = state.truncated(start)
        ids = state.tokens if history is None else history[None]
        feed = self._engine.feed_for(base, ids[:, start:end], torch.ones_like(ids[:, :end], dtype=torch.bool), {})
        settled = self._engine.feed(base, feed, replace(self._settings(), logits=False))
        settled = settled.with_checkpoint(self.max_checkpoints)
        self._commit(replace(settled, media=state.media))
        return end - start

    # ----- internals ---------------------------------------------------------------------
    def _extension(self, input_ids: IdsLike, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                   inputs: dict[str, Any]) -> tuple[State, Feed, tuple[MediaItem, ...] | None]:
        """``extend``'s checked plan: the state it continues, the ``Feed`` and the media items it adds."""
        self._check_weights()
        ids = self._ids(input_ids)
        state = self._state_for_batch(ids.shape[0])
        ext = validate_extension(self._binding, state, ids, attention_mask, position_ids, inputs)
        return state, Feed(ext.ids, ext.mask, ext.positions, ext.inputs, ext.spans), ext.media

    def _extended(self, old: State, new: State, media: tuple[MediaItem, ...] | None) -> None:
        """Commit ``new``, the state after extending ``old`` by ``media`` items (a checkpoint at its end)."""
        self._commit(new.with_checkpoint(self.max_checkpoints).with_media(old, media))

    def _validate(self, input_ids: IdsLike, attention_mask: torch.Tensor | None,
                  kwargs: dict[str, Any]) -> Request:
        self._check_weights()
        request = validate(self._binding, self._fingerprint, input_ids, attention_mask, kwargs,
                           device=self.device, vocab_size=vocab_size(self.model))
        self._state_for_batch(request.batch_size)
        return request

    def _plan(self, request: Request) -> ResumePlan:
        own: list[tuple[str, StateSource]] = [("state", resume.Own(self._state_for_batch(request.batch_size)))]
        external = [] if request.query is None else [(n, resume.Guarded(s)) for n, s in self._caches()]
        return resume.choose([*own, *external], request, self._empty(request.batch_size),
                             rollback=self._binding.caps.rollback,
                             schedule=self._schedule(request.batch_size),
                             adopt=lambda found: self._adopt(found.to(self.device)))

    def _offer(self, outcome: Outcome, request: Request) -> None:
        """Offer the prompt (what a repeated request can reuse) and the conversation (what the next turn
        can) to every sink, before the commit: a Ctrl-C while writing leaves the session as it was.
        A compressed (budgeted) state is not the prompt's cache and is not offered."""
        if request.query is None or request.budget is not None:
            return
        for _, sink in self._caches():
            try:
                sink.offer((outcome.prefilled, outcome.state), request.query, self._engine.seconds_per_token)
            except Exception as exc:  # the answer is already computed; never lose it to a cache
                warnings.warn(f"kvstate: prefix store write failed: {type(exc).__name__}: {exc}", StoreWarning,
                              stacklevel=3)

    def _caches(self) -> list[tuple[str, PrefixCache]]:
        """``(name, cache)`` of the store (``ResumePlan.source`` "store") and the other sources, in order."""
        store = [] if self.store is None else [("store", self.store)]
        return [*store, *((s.name, s) for s in self.sources)]

    def _commit(self, state: State, plan: ResumePlan | None = None) -> None:
        """The only place the session's state changes."""
        self._state, self.last_plan = state, plan if plan is not None else self.last_plan

    def _check_weights(self) -> None:
        self._fingerprint = check_weights(self.model, self._fingerprint, self._state)

    def _settings(self) -> FeedSettings:
        return FeedSettings(self.chunk_size, self.checkpoint_every, self.max_checkpoints, self.canonical_chunk,
                            self.canonical_marks, self.prefill_rows, self._prepack, self._invariant)

    def _schedule(self, batch_size: int | None = None) -> Canonical:
        batch = self._state.batch_size if batch_size is None else batch_size
        return Canonical(self.canonical_chunk, self._engine.kernels(batch, self._settings()), self.canonical_marks)

    def _ids(self, input_ids: IdsLike) -> torch.Tensor:
        return as_ids(input_ids, self.device, vocab_size(self.model))

    def _empty(self, batch_size: int) -> State:
        reserve = max(self.sliding_reserve, self.canonical_chunk - 1)  # a resume restarts at the last cut
        return self._engine.empty(batch_size, reserve, self._fingerprint)

    def _adopt(self, state: State) -> State:
        return adopt(self._binding, self._fingerprint, state, vocab_size(self.model))

    def _state_for_batch(self, batch_size: int) -> State:
        state = self._state
        if state.is_empty and state.batch_size != batch_size:
            return self._empty(batch_size)
        check_batch(state, batch_size)
        return state

