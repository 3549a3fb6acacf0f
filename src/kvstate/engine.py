"""The engine: the only code in kvstate that runs the model.

Every run takes a ``State``, builds a transformers cache from it, runs the model,
and returns a new ``State``; it never changes the one it was given, so a failure
anywhere (an exception, Ctrl-C, a raising streamer) leaves the caller's state as
it was. Three runs exist:

* ``feed``: forwards over new tokens, in chunks (one token per forward where the
  family's continuation needs it), checkpointing recurrent layers on the way;
* ``generate``: ``model.generate`` over the *full* history, with its first forward
  (``_prefill``) replaced by ``feed`` of the unprocessed suffix, or by the stored
  logits when nothing is unprocessed. Generation options, logits processors,
  stopping criteria and streamers are therefore ``generate``'s own;
* ``observe``: queries and attention weights of watched tokens, for compression policies
  (the last tokens re-run, a question, or a reconstruction of the context); its state is discarded.

One ``Recorder`` captures what every forward saw (the positions of its tokens and
its last logits); new states are built from that record, never re-derived from
tensor shapes or step counts. A per-model lock serializes runs on one model
instance, so sessions sharing a model in several threads cannot see each other's
hooks or module-held states (RecurrentGemma, Qwen-VL ``rope_deltas``).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch

from . import _compat
from ._compat.watch import watching
from .errors import KVStateError, UnsupportedError
from .layers import FULL_ATTENTION, SLIDING_ATTENTION, LayerState
from .masks import layer_masks, needs_masks
from .options import GenerateOptions
from .protocols import ModelAdapter
from .state import State, next_position_after

Listener = Callable[[int, int, torch.Tensor, torch.Tensor, float, Any], None]
_LOCKS: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: torch.nn.Module) -> threading.RLock:
    """The lock every engine run on ``model`` holds (one per model instance)."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(model, threading.RLock())


@dataclass(frozen=True)
class Feed:
    """New tokens for the model: ``ids`` ``[B, Q]``, ``mask`` ``[B, T + Q]`` over processed + new
    slots, their ``positions`` ``[B, Q(, R)]``, and the model inputs that belong to them (pixels)."""

    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    inputs: Mapping[str, Any]


@dataclass(frozen=True)
class FeedSettings:
    """How ``feed`` splits its work: tokens per forward, checkpoint spacing, checkpoints kept."""

    chunk_size: int = 512
    checkpoint_every: int | None = None
    max_checkpoints: int = 16


@dataclass(frozen=True)
class Generated:
    """A ``generate`` run: the state after it, the state right after the history was fed (before
    decoding), the new tokens ``[B, N]``, and transformers' output."""

    state: State
    prefilled: State
    tokens: torch.Tensor
    output: Any


@dataclass(frozen=True)
class Forward:
    """One recorded forward: the positions of its tokens ``[B, Q(, R)]`` and its last logits ``[B, V]``."""

    positions: torch.Tensor
    logits: torch.Tensor


class Recorder:
    """Records what each forward of a model saw, through hooks that live for one run."""

    def __init__(self, adapter: ModelAdapter, next_position: torch.Tensor) -> None:
        self._adapter = adapter
        self._next = next_position
        self.forwards: list[Forward] = []
        self.current: torch.Tensor | None = None  # positions of the forward running now

    @contextmanager
    def attached(self, model: torch.nn.Module) -> Iterator[Recorder]:
        handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                   model.register_forward_hook(self._after, with_kwargs=True)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _before(self, _module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        given = kwargs.get("position_ids")
        if given is not None:
            self.current = self._adapter.state_positions(given)
        else:  # families without position ids: consecutive, as their own forward counts
            ids = kwargs.get("input_ids", args[0] if args else None)
            q = int((ids if ids is not None else kwargs["inputs_embeds"]).shape[1])
            self.current = self._next[:, None] + torch.arange(q, device=self._next.device)
        flat = self.current.amax(-1) if self.current.dim() == 3 else self.current
        self._next = flat[:, -1] + 1

    def _after(self, _module: Any, _args: tuple, _kwargs: dict[str, Any], output: Any) -> None:
        assert self.current is not None
        self.forwards.append(Forward(self.current, output.logits[:, -1, :].detach().clone()))

    def fed(self, n: int) -> Forward:
        """Positions of the first ``n`` recorded tokens, and the logits after the ``n``-th."""
        seen, parts = 0, []
        for forward in self.forwards:
            parts.append(forward.positions)
            seen += forward.positions.shape[1]
            if seen == n:
                return Forward(torch.cat(parts, dim=1), forward.logits)
        raise KVStateError("the model's forwards do not add up to the tokens fed", expected=n, found=seen,
                           fix="report this model with `kvstate verify --model ...`")


class Engine:
    """Runs one model for any number of sessions (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, adapter: ModelAdapter) -> None:
        self.model, self.adapter = model, adapter
        self.cache_kwarg = adapter.cache_kwarg(model)
        self.lock = model_lock(model)
        self.seconds_per_token = 0.0  # measured on the last prefill-sized forward

    # ----- preparing work (no forward) -----------------------------------------------------
    def empty(self, batch_size: int, sliding_reserve: int, fingerprint: Any) -> State:
        param = next(self.model.parameters())
        layers = self.adapter.empty_layers(self.model, sliding_reserve)
        return State.empty(layers, fingerprint, batch_size, param.device, self.adapter.caps.position_dims)

    def feed_for(self, state: State, ids: torch.Tensor, mask: torch.Tensor, inputs: Mapping[str, Any]) -> Feed:
        """The ``Feed`` of ``ids`` ``[B, Q]`` after ``state``; ``mask`` covers processed + new slots."""
        new_mask = mask[:, state.tokens_seen:]
        positions = self.adapter.chunk_positions(self.model, state.next_position, ids, new_mask, dict(inputs))
        return Feed(ids, mask, positions, MappingProxyType(dict(inputs)))

    # ----- runs ------------------------------------------------------------------------------
    def feed(self, state: State, feed: Feed, settings: FeedSettings) -> State:
        """The state after forwarding ``feed``; ``state.last_logits`` then holds the last position's logits."""
        with self.lock, torch.no_grad():
            out = self._run_feed(state, feed, settings, settings.chunk_size)
            self.adapter.restore_extras(self.model, dict(out.extras))  # the instance agrees with the state
        return out

    def generate(self, start: State, feed: Feed | None, history: torch.Tensor, mask: torch.Tensor,
                 options: GenerateOptions, settings: FeedSettings) -> Generated:
        """``model.generate`` over ``history`` ``[B, L]``, resuming from ``start`` plus ``feed``.

        ``feed`` is the unprocessed suffix (None when ``start`` has processed all of
        ``history`` and holds its last logits). The returned state holds every fed
        token: the history and all new tokens but the last.
        """
        if feed is None and start.last_logits is None:
            raise KVStateError("nothing to feed and no stored logits", expected="a feed of >= 1 token",
                               found=f"state of {start.tokens_seen} tokens without last_logits")
        positions = start.positions if feed is None else torch.cat([start.positions, feed.positions], dim=1)
        call: dict[str, Any] = {"input_ids": history, "attention_mask": mask.long(),
                                self.cache_kwarg: self.adapter.empty_cache(self.model, history.shape[0])}
        if self.adapter.caps.position_ids:
            call["position_ids"] = self.adapter.model_positions(positions)
        with self.lock, torch.no_grad(), ExitStack() as hooks:
            run: dict[str, Any] = {}

            def prefill() -> Any:
                chunk = options.prefill_chunk_size or settings.chunk_size
                prefilled = start if feed is None else self._run_feed(start, feed, settings, chunk)
                run["state"] = prefilled
                run["cache"] = self.adapter.build_cache(self.model, prefilled.layers, prefilled.batch_size)
                self.adapter.restore_extras(self.model, dict(prefilled.extras))
                run["recorder"] = hooks.enter_context(Recorder(self.adapter, prefilled.next_position).attached(
                    self.model))
                hooks.enter_context(self._masks(prefilled.layers, run["recorder"]))
                return self.adapter.lm_output(self.model, prefilled.last_logits[:, None, :],  # type: ignore[index]
                                              run["cache"])

            with _compat.replaced_prefill(self.model, prefill):
                output = self.model.generate(**call, **options.kwargs)
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            new = sequences[:, history.shape[1]:]
            state = self._after_decode(run["state"], run["cache"], run["recorder"], new, mask)
            self.adapter.restore_extras(self.model, dict(state.extras))
        if not isinstance(output, torch.Tensor):
            output.sequences = new
            setattr(output, _compat.CACHE_KWARG, None)  # the state is the cache; never hand out its tensors
        return Generated(state, run["state"], new, output)

    def observe(self, state: State, ids: torch.Tensor, listener: Listener, *, rerun: int = 0,
                chunk_size: int = 512) -> None:
        """Feed ``ids`` ``[B, Q]`` with attention watched (eager), and discard the state that makes.

        ``ids`` follow ``state`` rolled back by ``rerun`` tokens (re-running its last
        ``rerun`` tokens when ``ids`` are those tokens). ``listener(layer, first_key,
        query, weights, scaling, rope)`` sees every attention layer of every forward:
        post-RoPE queries ``[B, Hq, q, D]``, weights ``[B, Hq, q, K]`` whose first column is
        key ``first_key`` of the layer (slot ``j`` of the base state is key ``j``; fed
        tokens follow), and the layer's RoPE tables.
        """
        T = state.tokens_seen
        reasons = state.rollback_limit(T - rerun) if rerun <= T else [f"only {T} tokens"]
        if reasons:
            raise UnsupportedError(f"this policy re-runs the last {rerun} tokens, and the state cannot roll back "
                                   "that far", found="; ".join(reasons),
                                   fix="use KNorm, StreamingLLM or Random, a smaller window, or checkpoint_every")
        base = state.truncated(T - rerun) if rerun else state
        keys = {i: layer.slots for i, layer in enumerate(base.layers) if layer.kind in (FULL_ATTENTION,
                                                                                       SLIDING_ATTENTION)}

        def counted(layer: int, query: torch.Tensor, weights: torch.Tensor, scaling: float, rope: Any) -> None:
            keys[layer] += query.shape[2]
            listener(layer, keys[layer] - weights.shape[-1], query, weights, scaling, rope)

        mask = torch.ones(ids.shape[0], base.tokens_seen + ids.shape[1], dtype=torch.bool, device=ids.device)
        with self.lock, torch.no_grad(), watching(self.model, counted):
            speed = self.seconds_per_token  # eager scoring forwards say nothing of a prefill's cost
            try:
                self._run_feed(base, self.feed_for(base, ids, mask, {}), FeedSettings(chunk_size), chunk_size)
            finally:
                self.seconds_per_token = speed
                self.adapter.restore_extras(self.model, dict(state.extras))

    def reset_model(self) -> None:
        """Clear model-side values (e.g. ``rope_deltas``), as on a freshly loaded instance."""
        with self.lock:
            self.adapter.reset_model(self.model)

    # ----- internals ---------------------------------------------------------------------------
    def _run_feed(self, state: State, feed: Feed, settings: FeedSettings, chunk_size: int) -> State:
        T, Q, start = state.tokens_seen, feed.ids.shape[1], 0
        checkpointed = any(layer.checkpointed for layer in state.layers)
        while start < Q:
            size = self._chunk(state, Q - start, settings, chunk_size, bool(feed.inputs), checkpointed)
            end = min(start + size, Q)
            state = self._forward(state, feed.ids[:, start:end], feed.mask[:, :T + end],
                                  feed.positions[:, start:end], feed.inputs)
            every = settings.checkpoint_every
            if every and end < Q and state.tokens_seen % every == 0:
                state = state.with_checkpoint(settings.max_checkpoints)
            start = end
        return state

    def _chunk(self, state: State, remaining: int, settings: FeedSettings, chunk_size: int, whole: bool,
               checkpointed: bool) -> int:
        """Tokens in the next forward: stepwise families continue one token at a time; media go in whole."""
        if self.adapter.caps.stepwise and not state.is_empty:
            return 1
        size = remaining if whole else chunk_size
        every = settings.checkpoint_every
        if every and checkpointed:  # end chunks on checkpoint boundaries
            size = min(size, every - state.tokens_seen % every)
        return size

    def _forward(self, state: State, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 inputs: Mapping[str, Any]) -> State:
        """One forward over ``ids`` ``[B, q]``; ``mask`` ``[B, T + q]``; ``positions`` ``[B, q(, R)]``."""
        cache = self.adapter.build_cache(self.model, state.layers, state.batch_size)
        self.adapter.restore_extras(self.model, dict(state.extras))
        extra = self.adapter.forward_inputs(self.model, state.tokens, ids, dict(inputs))
        kwargs = dict(extra, input_ids=ids, attention_mask=_mask_arg(mask), use_cache=True, **self._keep_one(),
                      **{self.cache_kwarg: cache})
        if self.adapter.caps.position_ids:
            kwargs["position_ids"] = self.adapter.model_positions(positions)
        recorder = Recorder(self.adapter, state.next_position)
        begin = time.perf_counter()
        with recorder.attached(self.model), self._masks(state.layers, recorder), \
                self.adapter.forward_context(self.model):
            self.model(**kwargs)
        if ids.shape[1] > 8:
            self.seconds_per_token = (time.perf_counter() - begin) / ids.shape[1]
        seen = recorder.fed(ids.shape[1])
        layers = self.adapter.read_cache(self.model, cache, state.layers, seen.positions,
                                         state.tokens_seen + ids.shape[1])
        return self._advance(state, ids, mask, seen, layers)

    def _after_decode(self, state: State, cache: Any, recorder: Recorder, new: torch.Tensor,
                      mask: torch.Tensor) -> State:
        """The state after ``generate``: every generated token but the last went through the model."""
        n = new.shape[1] - 1
        if n <= 0:
            return state
        seen = recorder.fed(n)
        layers = self.adapter.read_cache(self.model, cache, state.layers, seen.positions, state.tokens_seen + n)
        full = torch.cat([mask, torch.ones_like(new[:, :n], dtype=torch.bool)], dim=1)
        return self._advance(state, new[:, :n], full, seen, layers)

    def _advance(self, state: State, fed: torch.Tensor, mask: torch.Tensor, seen: Forward,
                 layers: tuple[LayerState, ...]) -> State:
        """``state`` plus the ``fed`` tokens ``[B, q]``; ``mask`` covers all ``T + q`` slots."""
        T, n = state.tokens_seen, state.tokens_seen + fed.shape[1]
        next_position = next_position_after(seen.positions, mask[:, T:n], state.next_position)
        extras = self.adapter.capture_extras(self.model, next_position, n)
        return replace(state, tokens=torch.cat([state.tokens, fed], dim=1), mask=mask[:, :n],
                       positions=torch.cat([state.positions, seen.positions], dim=1), layers=layers,
                       next_position=next_position, last_logits=seen.logits, extras=MappingProxyType(extras))

    def _keep_one(self) -> dict[str, int]:
        """Only the last position's logits are needed, where the model can skip the rest."""
        return {"logits_to_keep": 1} if self.adapter.caps.logits_to_keep else {}

    def _masks(self, layers: tuple[LayerState, ...], recorder: Recorder) -> AbstractContextManager[Any]:
        """Per-layer masks while a compressed state is in use; nothing otherwise (bitwise the plain path)."""
        return layer_masks(self.model, layers, recorder) if needs_masks(layers) else nullcontext()


def _mask_arg(mask: torch.Tensor) -> torch.Tensor | None:
    """Drop an all-ones mask, as ``generate`` does, so both paths run the same kernels."""
    return None if bool(mask.all()) else mask.long()
