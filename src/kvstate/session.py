"""``Session``: one explicit ``State`` for one loaded transformers model.

Every verb takes one walk (``docs/architecture.md``): **validate** the input (``kvstate.request``), **plan**
with pure code which source's state to start from and which prefix to keep (``kvstate.resume``: the session's
own state, then a pool or a store), **run** the ``Engine``, which returns a new ``State``, and **commit** it with
one assignment after offering it to the sinks. States are immutable, so an exception anywhere, Ctrl-C included,
leaves ``session.state`` as it was; a failing source or sink costs a warning. ``fork`` is O(1). Under the canonical
schedule (``kvstate.schedule``) a warm answer is the cold answer bit for bit; a session continuing a state keeps
the state's schedule (``kvstate.settings``).
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from . import request as checks
from . import resume
from .adapters.fingerprinting import fingerprint as fingerprint_of
from .adopt import adopt, check_session_args, check_weights
from .engine import Engine, Outcome
from .errors import InputError
from .identity import Fingerprint
from .protocols import PrefixCache, StateSource
from .request import Extension, IdsLike, Request
from .resume import ResumePlan
from .schedule import Canonical
from .selfcheck import bind, vocab_size
from .settings import Settings, check_continues, fitted, resolve
from .state import MediaItem, State

if TYPE_CHECKING:
    from .compress.report import Compression


class Session:
    """Owns the generation state of one conversation batch on one model (one thread at a time; sessions sharing a
    model may run in different threads: the engine serializes their runs).

    Args (``None``: the given ``state``'s own, else the default; every setting: ``kvstate.settings.Settings``):
        model: a transformers causal LM whose family kvstate supports; ``tokenizer``: only hashed into the fingerprint.
        canonical_chunk: ``C`` of the canonical schedule (warm = cold bit for bit); 0: off. Default: the device's.
        canonical_marks: token ids that start a turn (``kvstate.text.turn_marks``): cuts also fall there.
        chunk_size, sliding_reserve, max_checkpoints, checkpoint_every: forward length off the schedule, rollback room
            of sliding layers, recurrent snapshots. prefill_rows, prepack, invariant: tiled prefill (``Scheduler``'s).
        store, sources: ``PrefixCache`` s asked for prefixes and offered new states (a ``PrefixStore``, a pool).
        state: start from this state (checked against the model). fingerprint: ``kvstate.fingerprint(model,
            tokenizer)`` computed once by the caller (a server's sessions).
        settings: a ``kvstate.settings.Settings`` made by the caller (a ``Scheduler``'s, a server's), instead of
            the setting keywords above.
    """

    def __init__(self, model: torch.nn.Module, *, tokenizer: object | None = None, chunk_size: int = 512,
                 canonical_chunk: int | None = None, sliding_reserve: int | None = None, max_checkpoints: int = 16,
                 checkpoint_every: int | None = None, store: PrefixCache | None = None,
                 sources: Sequence[PrefixCache] = (), state: State | None = None,
                 canonical_marks: Sequence[int] | None = None, prefill_rows: int | None = None, prepack: bool = True,
                 invariant: bool = True, fingerprint: Fingerprint | None = None,
                 settings: Settings | None = None) -> None:
        checks.check_model_object(model)
        check_session_args(tokenizer, state, (*([] if store is None else [store]), *sources))
        self.model = model
        self._binding = bind(model)
        self._engine = Engine(self._binding)
        keywords = dict(chunk_size=chunk_size, canonical_chunk=canonical_chunk, canonical_marks=canonical_marks,
                        sliding_reserve=sliding_reserve, max_checkpoints=max_checkpoints,
                        checkpoint_every=checkpoint_every, prefill_rows=prefill_rows, prepack=prepack,
                        invariant=invariant)
        stepwise = self._binding.caps.stepwise
        self.settings: Settings = resolve(model, state, stepwise=stepwise, **keywords) if settings is None else \
            fitted(model, checks.check_given(settings, Settings, keywords, _DEFAULTS), stepwise=stepwise)
        self.store = store  # may be replaced or set to None later; it is read on every call
        self.sources: tuple[PrefixCache, ...] = tuple(sources)
        self._fingerprint = fingerprint or fingerprint_of(model, tokenizer)
        self._tokenizer = tokenizer  # KVzip's re-read asks it for the chat template (kvstate.compress.template)
        self.last_plan: ResumePlan | None = None
        self._state = self._empty(1) if state is None else self._adopt(state)
        if state is not None:
            check_continues(self._state, self.settings, self._schedule().device)

    # ----- read-only views -------------------------------------------------------------
    @property
    def state(self) -> State:
        """The current state; its tensors are shared with forks and files: read-only (``state.clone()`` copies)."""
        return self._state

    @property
    def tokens(self) -> torch.Tensor:
        """Processed token ids ``[B, T]`` (a copy)."""
        return self._state.tokens.clone()

    @property
    def fingerprint(self) -> Fingerprint:
        return self._fingerprint

    @property
    def canonical_chunk(self) -> int:
        """``C`` of this session's schedule (0: off)."""
        return self.settings.canonical_chunk

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ----- state verbs -----------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything: outputs then equal a freshly loaded model's."""
        self._engine.reset_model()
        self._fingerprint = replace(fingerprint_of(self.model), tokenizer_hash=self._fingerprint.tokenizer_hash)
        self._commit(self._empty(1))

    def fork(self) -> Session:
        """An independent session on the same model, starting from this state. O(1)."""
        twin = copy.copy(self)  # same model, so the adoption checks would be redundant
        twin.last_plan = None
        return twin

    def truncate(self, n_tokens: int) -> None:
        """Roll back to the first ``n_tokens`` slots; ``RollbackError`` if a layer cannot."""
        self._commit(self._state.truncated(checks.validate_truncate(self._binding, self._state, n_tokens)))

    def compress(self, policy: Any, *, query_ids: IdsLike | None = None, sliding: str = "window",
                 budget: int | None = None) -> Compression:
        """Evict slots with ``policy`` (e.g. ``KVzip(0.5)``, ``kvstate.compress``); retained slots keep their
        positions. ``query_ids`` ``[B, Q]``: question-aware scoring; ``budget``: slots per layer, not the ratio.
        Returns what was kept (``Compression``: K/V entries and bytes before and after)."""
        from .compress.apply import compress_state
        from .compress.report import compression

        self._check_weights()
        query = None if query_ids is None else self._ids(query_ids)
        if query is not None:
            checks.check_batch(self._state, query.shape[0])
        before = self._state
        self._commit(compress_state(self._engine, self.model, before, policy, query_ids=query, sliding=sliding,
                                    budget=budget, tokenizer=self._tokenizer))
        return compression(before, self._state)

    def save(self, path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None,
             compact: str | None = None) -> int:
        """Write the state to one crash-safe file (see ``kvstate.save_state``); returns bytes."""
        from .io import save_state

        return save_state(self._state, path, metadata=metadata, compact=compact)

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: torch.nn.Module, *, cast_dtype: bool = False,
             **settings: Any) -> Session:
        """A session on ``model`` continuing the state saved at ``path`` (checked against the model, moved to its
        device; ``cast_dtype=True`` casts another dtype, recorded in its metadata) under the state's own schedule
        unless ``settings`` (``Session``'s) say otherwise."""
        from .io import load_state

        checks.check_model_object(model)
        if not isinstance(cast_dtype, bool):
            raise InputError("cast_dtype must be True or False", found=repr(cast_dtype), fix="pass cast_dtype=True")
        param = next(model.parameters())
        state = load_state(path, map_location=param.device, dtype=param.dtype if cast_dtype else None)
        return cls(model, state=state, **settings)

    # ----- feeding tokens --------------------------------------------------------------
    def extend(self, input_ids: IdsLike, attention_mask: torch.Tensor | None = None, *,
               position_ids: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        """Process new ids ``[B, Q]`` and return the last position's logits ``[B, V]`` (a fresh tensor).
        ``attention_mask`` ``[B, T + Q]`` covers processed + new slots (None: no padding in the new ones);
        ``position_ids`` ``[B, Q]`` must continue the state (checked); ``inputs``: the media of these tokens."""
        state, ext = self._extension(input_ids, attention_mask, position_ids, inputs)
        new = self._engine.feed(state, ext.feed, self.settings)
        self._extended(state, new, ext.media)
        return new.last_logits.clone()  # type: ignore[union-attr]

    @staticmethod
    def extend_many(sessions: Sequence[Session], input_ids: Sequence[IdsLike]) -> None:
        """``sessions[i].extend(input_ids[i])`` (text ids ``[1, Q_i]``) for every ``i``, the chunks of a round packed
        into one forward where the ``prefill_rows`` tile them; each state is bitwise its own ``extend``'s. The
        sessions share one model and settings; every input is checked before any forward (none changes on a failure)."""
        checks.check_many([(s.model, s.settings) for s in sessions], len(input_ids))
        planned = [s._extension(ids, None, None, {}) for s, ids in zip(sessions, input_ids, strict=True)]
        new = sessions[0]._engine.feed_many([p[0] for p in planned], [p[1].feed for p in planned],
                                            sessions[0].settings) if sessions else []
        for session, (old, ext), state in zip(sessions, planned, new, strict=True):
            session._extended(old, state, ext.media)

    def generate(self, input_ids: IdsLike, attention_mask: torch.Tensor | None = None, **generate_kwargs: Any) -> Any:
        """Continue the *full* history ``input_ids`` ``[B, L]`` like ``model.generate(input_ids, **options)`` (every
        option behaves as there; ``kvstate.options`` lists the few refused). Reuses the longest processed prefix the
        schedule allows, rolls back where the layers allow (else resumes from a checkpoint, else re-feeds), feeds
        the rest and returns the new ids ``[B, N]`` (or transformers' output object, its ``sequences`` the new ids).
        A ``streamer`` with ``put_logits(logits)`` gets each step's raw logits ``[B, V]`` first.
        ``compress=policy, budget=B, every=N`` decodes on at most ``B`` slots per attention layer."""
        return self.run(input_ids, attention_mask, **generate_kwargs).output

    def run(self, input_ids: IdsLike, attention_mask: torch.Tensor | None = None, **generate_kwargs: Any) -> Outcome:
        """``generate``, returning the whole ``Outcome`` (new ids, output, slots reused, ``finish_reason`` s)."""
        request, plan = self._planned(input_ids, attention_mask, generate_kwargs)
        outcome = self._engine.run(plan, request, self.settings)
        self._offer(outcome, request)
        self._commit(outcome.state, plan)
        return outcome

    def take_prefix(self, input_ids: IdsLike, attention_mask: torch.Tensor | None = None, **inputs: Any) -> int:
        """Make the state the longest prefix of the history ``[B, L]`` that ``run`` would reuse (feeding nothing);
        returns its length. Then ``extend`` up to cuts of the schedule and ``run`` the whole history: each forward
        is one a single ``run`` makes, so the answer is bitwise its answer (``kvstate.batch`` feeds so)."""
        # one new token keeps generate's length checks from refusing a history run accepts
        _, plan = self._planned(input_ids, attention_mask, {"max_new_tokens": 1, **inputs})
        self._commit(plan.start, plan)  # type: ignore[arg-type]
        return plan.start.tokens_seen  # type: ignore[union-attr]

    def settle(self, through: IdsLike | None = None) -> int:
        """Recompute in canonical chunks the slots a resume would feed again (a decoded answer, up to the state's
        last cut; or, given ``through`` ``[L]``, the ids the next turn's history begins with, up to ``L``). Returns
        the slots fed (0: nothing to do, or not possible: schedule off, a batch, padding, media, no rollback).
        The settled state holds no logits (its last chunk skips the output head, as the cold run's chunk ending
        at a cut does): the next call feeds on from there. Transactional; a server runs it after a reply."""
        state = self._state
        history = None if through is None else checks.check_through(through, self.device, vocab_size(self.model))
        span = resume.settle_span(state, self._schedule(), history)
        if span is None:
            return 0
        ids = state.tokens if history is None else history[None]
        self._commit(self._engine.refeed(state, ids, *span, self.settings))
        return span[1] - span[0]

    # ----- internals ---------------------------------------------------------------------
    def _extension(self, input_ids: IdsLike, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                   inputs: dict[str, Any]) -> tuple[State, Extension]:
        """``extend``'s checked plan: the state it continues and the validated ``Extension``."""
        self._check_weights()
        ids = self._ids(input_ids)
        state = self._state_for_batch(ids.shape[0])
        return state, checks.validate_extension(self._binding, state, ids, attention_mask, position_ids, inputs)

    def _extended(self, old: State, new: State, media: tuple[MediaItem, ...] | None) -> None:
        self._commit(new.with_checkpoint(self.settings.max_checkpoints).with_media(old, media))

    def _planned(self, input_ids: IdsLike, attention_mask: torch.Tensor | None,
                 kwargs: dict[str, Any]) -> tuple[Request, ResumePlan]:
        """The validated request and its plan over the session's own state, then the store and the sources."""
        self._check_weights()
        request = checks.validate(self._binding, self._fingerprint, input_ids, attention_mask, kwargs,
                                  device=self.device, vocab_size=vocab_size(self.model))
        own: list[tuple[str, StateSource]] = [("state", resume.Own(self._state_for_batch(request.batch_size)))]
        external = [] if request.query is None else [(n, resume.Guarded(s)) for n, s in self._caches()]
        return request, resume.choose([*own, *external], request, self._empty(request.batch_size),
                                      rollback=self._binding.caps.rollback,
                                      schedule=self._schedule(request.batch_size),
                                      adopt=lambda found: self._adopt(found.to(self.device)))

    def _offer(self, outcome: Outcome, request: Request) -> None:
        """Offer the prompt's and the conversation's states to every sink, before the commit (``resume.offer``)."""
        if request.query is not None and request.budget is None:  # a budgeted state is not the prompt's cache
            resume.offer([c for _, c in self._caches()], (outcome.prefilled, outcome.state), request.query,
                         self._engine.seconds_per_token)

    def _caches(self) -> list[tuple[str, PrefixCache]]:
        """``(name, cache)`` of the store (``ResumePlan.source`` "store") and the other sources, in order."""
        return [*([] if self.store is None else [("store", self.store)]), *((s.name, s) for s in self.sources)]

    def _commit(self, state: State, plan: ResumePlan | None = None) -> None:
        """The only place the session's state changes."""
        self._state, self.last_plan = state, plan if plan is not None else self.last_plan

    def _check_weights(self) -> None:
        self._fingerprint = check_weights(self.model, self._fingerprint, self._state)

    def _schedule(self, batch_size: int | None = None) -> Canonical:
        batch = self._state.batch_size if batch_size is None else batch_size
        s = self.settings
        return Canonical(s.canonical_chunk, self._engine.kernels(batch, s), s.canonical_marks)

    def _ids(self, input_ids: IdsLike) -> torch.Tensor:
        return checks.as_ids(input_ids, self.device, vocab_size(self.model))

    def _empty(self, batch_size: int) -> State:
        return self._engine.empty(batch_size, self.settings.reserve, self._fingerprint)

    def _adopt(self, state: State) -> State:
        return adopt(self._binding, self._fingerprint, state, vocab_size(self.model))

    def _state_for_batch(self, batch_size: int) -> State:
        state = self._state
        if state.is_empty and state.batch_size != batch_size:
            return self._empty(batch_size)
        checks.check_batch(state, batch_size)
        return state


# what Session's keywords are when not given: a caller passing ``settings=`` leaves them so
_DEFAULTS = {name: p.default for name, p in inspect.signature(Session.__init__).parameters.items()}
