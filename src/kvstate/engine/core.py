"""The engine: the only code in kvstate that runs the model.

Every run takes a ``State``, attaches it to the model (``Runtime.attached``: a
transformers cache and the model-side extras), runs the model, and returns a new
``State``; it never changes the one it was given, so a failure anywhere (an
exception, Ctrl-C, a raising streamer) leaves the caller's state as it was. The runs:

* ``feed``: forwards over new tokens, in chunks. Under the canonical schedule
  (``kvstate.schedule``) a feed that starts at a cut of a canonical prefix ends its
  chunks at the schedule's cuts, so each slot gets the bits the cold run gives it;
  otherwise chunks of ``chunk_size`` (one token per forward where the family's
  continuation needs it). Recurrent layers are checkpointed on the way;
* ``run``: one planned ``generate`` call (``kvstate.resume.ResumePlan`` + ``kvstate.request.Request``)
  to an ``Outcome``: ``model.generate`` over the *full* history, with its first forward
  (``_prefill``) replaced by ``feed`` of the unprocessed suffix, or by the stored logits
  when nothing is unprocessed; or budgeted rounds (``kvstate.engine.budgeted``);
* ``observe``: queries and attention weights of watched tokens, for compression policies;
  its state is discarded.

One ``Recorder`` captures what every forward saw; new states are built from that
record, never re-derived from tensor shapes or step counts. A per-model lock
serializes runs on one model instance, so sessions sharing a model in several
threads cannot see each other's hooks or module-held states.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from .._compat import attention
from .._compat.core import CACHE_KWARG
from .._compat.generation import replaced_prefill, without_logits
from .._compat.watch import Watched, watching
from ..adapters.binding import Binding, Live
from ..errors import GenerationOptionError, KVStateError, UnsupportedError
from ..layers import FULL_ATTENTION, HYBRID, SLIDING_ATTENTION, LayerState
from ..masks import layer_masks, needs_masks
from ..options import GenerateOptions
from ..request import Feed
from ..schedule import Canonical
from ..settings import Settings
from ..state import State, next_position_after
from . import room
from .batched.prefill import Piece, Tiled, tiled_for
from .budgeted import run_budgeted
from .feeding import FeedRun, canonical_ends, history
from .recorder import Forward, Recorder, model_lock
from .values import Outcome, finish_reasons

if TYPE_CHECKING:
    from ..capabilities import Capabilities
    from ..identity import Fingerprint
    from ..protocols import ModelInputs
    from ..request import Request
    from ..resume import ResumePlan

Listener = Callable[[int, Watched], None]


class Engine:
    """Runs one bound model for any number of sessions (see the module docstring)."""

    def __init__(self, binding: Binding) -> None:
        self.binding = binding
        self.model = binding.model
        self.runtime = binding.runtime
        self.cache_kwarg = self.runtime.cache_kwarg
        self.lock = model_lock(self.model)
        self.seconds_per_token = 0.0  # measured on the last prefill-sized forward

    # ----- preparing work (no forward) -----------------------------------------------------
    def empty(self, batch_size: int, sliding_reserve: int, fingerprint: Fingerprint | None) -> State:
        param = next(self.model.parameters())
        layers = self.binding.layout.empty_layers(sliding_reserve)
        return State.empty(layers, fingerprint, batch_size, param.device, self.binding.caps.position_dims)

    def feed_for(self, state: State, ids: torch.Tensor, mask: torch.Tensor, inputs: ModelInputs,
                 spans: tuple[tuple[int, int], ...] = ()) -> Feed:
        """The ``Feed`` of ``ids`` ``[B, Q]`` after ``state``; ``mask`` covers processed + new slots;
        ``spans`` are the history's media items (those inside the feed are kept)."""
        T = state.tokens_seen
        positions = self.binding.inputs.positions(state.next_position, ids, mask[:, T:], inputs)
        inside = tuple((a, b) for a, b in spans if a >= T and b <= T + ids.shape[1])
        return Feed(ids, mask, positions, MappingProxyType(dict(inputs)), inside)

    # ----- runs ------------------------------------------------------------------------------
    def feed(self, state: State, feed: Feed, settings: Settings, logits: bool = True) -> State:
        """The state after forwarding ``feed``; ``state.last_logits`` then holds the last position's logits
        (``logits=False``: none; the last chunk skips the output head too, its K/V the same bits)."""
        return self.feed_many([state], [feed], settings, logits)[0]

    def run(self, plan: ResumePlan, request: Request, settings: Settings) -> Outcome:
        """One planned ``generate`` call: feed the plan's suffix of ``request.ids``, then decode."""
        start = plan.start
        T = start.tokens_seen
        self.binding.inputs.check(request.ids, request.inputs, T)
        feed = None
        if plan.fed:
            inputs = self.binding.inputs.select(request.ids, T, request.inputs)
            feed = self.feed_for(start, request.ids[:, T:], request.mask, inputs, request.spans)
        if request.budget is not None:  # rounds of generate under a slot budget (KV compression)
            outcome = run_budgeted(self, start, feed, request, settings, plan.reused)
        else:
            state, prefilled, new, output = self.generate(start, feed, request.ids, request.mask,
                                                          request.options, settings)
            answer = output if request.options.return_dict else new
            outcome = Outcome(state, prefilled, new, answer, plan.reused,
                              finish_reasons(new, request.options, request.ids.shape[1]))
        return outcome.recorded(start, request.media, settings.max_checkpoints)

    def generate(self, start: State, feed: Feed | None, history: torch.Tensor, mask: torch.Tensor,
                 options: GenerateOptions, settings: Settings) -> tuple[State, State, torch.Tensor, object]:
        """``model.generate`` over ``history`` ``[B, L]``, resuming from ``start`` plus ``feed``.

        ``feed`` is the unprocessed suffix (None when ``start`` has processed all of
        ``history`` and holds its last logits). Returns the state after the run (the history
        and all new tokens but the last), the state right after the history, the new tokens
        ``[B, N]`` and ``generate``'s output (whose ``sequences`` are the new tokens).
        """
        if feed is None and start.last_logits is None:
            raise KVStateError("nothing to feed and no stored logits", expected="a feed of >= 1 token",
                               found=f"state of {start.tokens_seen} tokens without last_logits")
        positions = start.positions if feed is None else torch.cat([start.positions, feed.positions], dim=1)
        call: dict[str, object] = {"input_ids": history, "attention_mask": mask.long(),
                                   self.cache_kwarg: self.runtime.empty_cache(history.shape[0])}
        if self.binding.caps.position_ids:
            call["position_ids"] = self.runtime.model_positions(positions)
        with self.lock, torch.no_grad(), ExitStack() as hooks:
            run: dict[str, object] = {}
            kwargs = _with_step_logits(options.kwargs, run)

            def prefill() -> object:
                run["started"] = True  # past generate's entry checks: a failure from here on is not an option's
                chunk = options.prefill_chunk_size or settings.chunk_size
                prefilled = start if feed is None else self._run_feed(start, feed, settings, chunk)
                live = hooks.enter_context(self.runtime.attached(prefilled))
                # static room for the decode: each step writes its slot in place, not concatenated (fixed addresses)
                room.reserve(live.cache, _room(options, history.shape[1]))
                recorder = hooks.enter_context(Recorder(self.runtime, prefilled.next_position).attached(self.model))
                hooks.enter_context(self._masks(prefilled.layers, recorder))
                run.update(state=prefilled, live=live, recorder=recorder)
                return self.runtime.lm_output(prefilled.last_logits[:, None, :], live.cache)  # type: ignore[index]

            hooks.enter_context(attention.deterministic(self.model))  # every decode step too
            with replaced_prefill(self.model, prefill), _refused_at_entry(run):
                output = self.model.generate(**call, **kwargs)
            sequences = output if isinstance(output, torch.Tensor) else output.sequences
            new = sequences[:, history.shape[1]:]
            prefilled: State = run["state"]  # type: ignore[assignment]
            room.compact(run["live"].cache)  # type: ignore[attr-defined]  # the state owns contiguous K/V, no room
            state = self._after_decode(prefilled, run["live"], run["recorder"], new, mask)  # type: ignore[arg-type]
            self.runtime.restore(state.extras)
        if not isinstance(output, torch.Tensor):
            output.sequences = new
            setattr(output, CACHE_KWARG, None)  # the state is the cache; never hand out its tensors
        return state, prefilled, new, output

    def refeed(self, state: State, ids: torch.Tensor, start: int, end: int, settings: Settings) -> State:
        """``state`` cut back to ``start`` slots and fed the history ``ids[:, start:end]`` (``[1, L]``) again under
        ``settings``: a decoded answer recomputed in canonical chunks (``Session.settle``); media records kept."""
        base = state.truncated(start)
        feed = self.feed_for(base, ids[:, start:end], torch.ones_like(ids[:, :end], dtype=torch.bool), {})
        settled = self.feed(base, feed, settings, logits=False)  # K/V only: the next call feeds on
        return replace(settled.with_checkpoint(settings.max_checkpoints), media=state.media)

    def observe(self, state: State, ids: torch.Tensor, listener: Listener, *, rerun: int = 0,
                chunk_size: int = 512, fresh: bool = False, weights: bool = True, norms: bool = False) -> None:
        """Feed ``ids`` ``[B, Q]`` with attention watched, and discard the state that makes.

        ``ids`` follow ``state`` rolled back by ``rerun`` tokens (re-running its last ``rerun`` tokens when
        ``ids`` are those tokens), or (``fresh``) an empty state of the same model (the whole prefill again).
        ``listener(first_key, watched)`` sees every attention layer of every forward (``_compat.watch.Watched``:
        post-RoPE queries ``[B, Hq, q, D]``, keys, values, eager weights ``[B, Hq, q, K]`` unless
        ``weights=False``, RoPE tables); the first key of the call is key ``first_key`` of the layer (slot
        ``j`` of the base state is key ``j``; fed tokens follow).
        """
        T = state.tokens_seen
        reasons = [] if fresh else state.rollback_limit(T - rerun) if rerun <= T else [f"only {T} tokens"]
        if reasons:
            raise UnsupportedError(f"this policy re-runs the last {rerun} tokens, and the state cannot roll back "
                                   "that far", found="; ".join(reasons),
                                   fix="use KNorm, StreamingLLM or Random, a smaller window, or checkpoint_every")
        base = self.empty(state.batch_size, 0, state.fingerprint) if fresh else \
            state.truncated(T - rerun) if rerun else state
        keys = {i: layer.slots for i, layer in enumerate(base.layers) if layer.kind in (FULL_ATTENTION,
                                                                                       SLIDING_ATTENTION, HYBRID)}

        counted = _Counted(listener, keys)

        mask = torch.ones(ids.shape[0], base.tokens_seen + ids.shape[1], dtype=torch.bool, device=ids.device)
        with self.lock, torch.no_grad(), watching(self.model, counted, weights, norms):
            speed = self.seconds_per_token  # scoring forwards say nothing of a prefill's cost
            try:
                self._run_feed(base, self.feed_for(base, ids, mask, {}), Settings(chunk_size, canonical_chunk=0),
                               chunk_size)
            finally:
                self.seconds_per_token = speed
                self.runtime.restore(state.extras)

    @property
    def caps(self) -> Capabilities:
        """What the bound family can do (read by compression: per-head masks, positions)."""
        return self.binding.caps

    def reset_model(self) -> None:
        """Clear model-side values (e.g. ``rope_deltas``), as on a freshly loaded instance."""
        with self.lock:
            self.runtime.reset()

    # ----- internals ---------------------------------------------------------------------------
    def _run_feed(self, state: State, feed: Feed, settings: Settings, chunk_size: int) -> State:
        run = self._feed_run(state, feed, settings, chunk_size)
        self._drive([run], settings)
        return run.state

    def feed_many(self, states: list[State], feeds: list[Feed], settings: Settings,
                  logits: bool = True) -> list[State]:
        """``feed`` of each ``feeds[i]`` after ``states[i]``, in lockstep: with a prefill tile
        (``settings.prefill_rows``) the chunks of one round that fit run in one packed forward (at most
        ``MAX_PACKED`` rows), each with the bits it gets alone (``kvstate.engine.batched.prefill``)."""
        with self.lock, torch.no_grad():
            runs = [self._feed_run(s, f, settings, settings.chunk_size, logits)
                    for s, f in zip(states, feeds, strict=True)]
            self._drive(runs, settings)
            for run in runs[-1:]:
                self.runtime.restore(run.state.extras)  # the instance agrees with the last state
        return [run.state for run in runs]

    def _drive(self, runs: list[FeedRun], settings: Settings) -> None:
        """Every run's chunks, a round at a time: the chunks that fit the prefill tiles in shared tiled forwards,
        the others in plain forwards of their own."""
        tiles = self.tiles(settings)
        while active := [run for run in runs if not run.done]:
            tiled, plain = [], []
            for run in active:
                chunk = run.chunk()
                fits = tiles is not None and tiles.fits(self, run.state, chunk[0], chunk[1], chunk[3])
                (tiled if fits else plain).append((run, chunk))
            for group in _groups(tiled, MAX_PACKED):
                pieces = [Piece(run.state, ids, mask, positions, logits)
                          for run, (ids, mask, positions, _, logits) in group]
                for (run, _), new in zip(group, self._tiled(tiles, pieces), strict=True):  # type: ignore[arg-type]
                    run.advance(new)
            for run, chunk in plain:
                run.advance(self._forward(run.state, *chunk))

    def _feed_run(self, state: State, feed: Feed, settings: Settings, chunk_size: int,
                  logits: bool = True) -> FeedRun:
        label = self.kernels(state.batch_size, settings)
        return FeedRun(self.binding, state, feed, settings, chunk_size, label, logits)

    def tiles(self, settings: Settings) -> Tiled | None:
        """The prefill tiles of ``settings`` (None: plain forwards)."""
        return tiled_for(self, settings.prefill_rows, settings.prepack, settings.invariant) \
            if settings.prefill_rows else None

    def kernels(self, batch_size: int, settings: Settings) -> str:
        """The label of the kernels a feed of ``batch_size`` rows runs its chunks on under ``settings``, as
        canonical states record it: the device (the GPU's identity on CUDA) and attention path
        (``kvstate._compat.attention.kernels``), plus the prefill tile where the family runs one."""
        device = attention.kernels(self.model)
        tiles = self.tiles(settings) if batch_size == 1 else None
        return device if tiles is None or not tiles.usable(self) else tiles.label(device)

    def canonical_cuts(self, state: State, ids: torch.Tensor, settings: Settings) -> list[int] | None:
        """The chunk ends (absolute; the last is ``T + Q``) of ``feed`` over the text ids ``[1, Q]`` after
        ``state``; None where that feed does not follow the canonical schedule (``feeding.canonical_ends``).
        ``kvstate.batch`` feeds a long history up to these cuts, a piece a step."""
        schedule = Canonical(settings.canonical_chunk, marks=settings.canonical_marks)
        spans = tuple((m.start, m.end) for m in state.media)
        return canonical_ends(self.binding, state, ids, settings, schedule, history(state, ids, settings), spans,
                              self.kernels(state.batch_size, settings))

    def _forward(self, state: State, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 inputs: ModelInputs, logits: bool = True) -> State:
        """One plain forward over ``ids`` ``[B, q]``; ``mask`` ``[B, T + q]``; ``positions`` ``[B, q(, R)]``.
        Without ``logits`` (a feed's inner chunk: the next chunk replaces them) the output head is skipped and
        the state's ``last_logits`` is None; the K/V are the same bits either way."""
        extra = self.runtime.forward_inputs(state.tokens, ids, inputs)
        with self.runtime.attached(state) as live:
            kwargs = dict(extra, input_ids=ids, attention_mask=_mask_arg(mask), use_cache=True, **self._keep_one(),
                          **{self.cache_kwarg: live.cache})
            if self.binding.caps.position_ids:
                kwargs["position_ids"] = self.runtime.model_positions(positions)
            recorder = Recorder(self.runtime, state.next_position)
            begin = time.perf_counter()
            head = nullcontext() if logits else without_logits(self.model)
            with recorder.attached(self.model), self._masks(state.layers, recorder), self.runtime.forward_context(), \
                    attention.deterministic(self.model), head:
                self.model(**kwargs)
            if ids.shape[1] > 8:
                self.seconds_per_token = (time.perf_counter() - begin) / ids.shape[1]
            return self._advance(state, ids, mask, recorder.fed(ids.shape[1]), live)

    def _tiled(self, tiles: Tiled, pieces: list[Piece]) -> list[State]:
        begin = time.perf_counter()
        states = tiles.run(self, pieces)
        rows = sum(p.ids.shape[1] for p in pieces)
        if rows > 8:
            self.seconds_per_token = (time.perf_counter() - begin) / rows
        return states

    def _after_decode(self, state: State, live: Live, recorder: Recorder, new: torch.Tensor,
                      mask: torch.Tensor) -> State:
        """The state after ``generate``: every generated token but the last went through the model.
        After a history that ends in padding, ``generate`` numbers the new tokens from that pad's
        position 0; no fresh run of a longer history gives them those positions, so they stay out
        (the next turn feeds them) and the state ends with the history."""
        n = new.shape[1] - 1
        if n <= 0 or not bool(mask[:, -1].all()):
            return state
        full = torch.cat([mask, torch.ones_like(new[:, :n], dtype=torch.bool)], dim=1)
        return self._advance(state, new[:, :n], full, recorder.fed(n), live)

    def _advance(self, state: State, fed: torch.Tensor, mask: torch.Tensor, seen: Forward, live: Live) -> State:
        """``state`` plus the ``fed`` tokens ``[B, q]``; ``mask`` covers all ``T + q`` slots. The new slots
        are not canonical: ``_run_feed`` marks them where they are."""
        T, n = state.tokens_seen, state.tokens_seen + fed.shape[1]
        next_position = next_position_after(seen.positions, mask[:, T:n], state.next_position)
        layers, extras = live.read(seen.positions, n, next_position)
        return replace(state, tokens=torch.cat([state.tokens, fed], dim=1), mask=mask[:, :n],
                       positions=torch.cat([state.positions, seen.positions], dim=1), layers=layers,
                       next_position=next_position, last_logits=seen.logits, extras=MappingProxyType(extras),
                       canonical=min(state.canonical, T))

    def _keep_one(self) -> dict[str, int]:
        """Only the last position's logits are needed, where the model can skip the rest."""
        return {"logits_to_keep": 1} if self.binding.caps.logits_to_keep else {}

    def _masks(self, layers: tuple[LayerState, ...], recorder: Recorder) -> AbstractContextManager[object]:
        """Per-layer masks while a compressed state is in use; nothing otherwise (bitwise the plain path)."""
        return layer_masks(self.model, layers, recorder) if needs_masks(layers) else nullcontext()


class _Counted:
    """The watch listener of ``Engine.observe``: tells ``listener`` which key each call's first key is (``keys``:
    the layer's keys so far), and passes on a listener's ``attend`` (one that computes the attention itself)."""

    def __init__(self, listener: Listener, keys: dict[int, int]) -> None:
        self.listener, self.keys = listener, keys

    def __call__(self, watched: Watched) -> None:
        self.keys[watched.layer] += watched.query.shape[2]
        self.listener(self.keys[watched.layer] - watched.key.shape[2], watched)

    def attend(self, watched: Watched) -> torch.Tensor | None:
        inner = getattr(self.listener, "attend", None)
        if inner is None:
            return None
        first = self.keys[watched.layer] + watched.query.shape[2] - watched.key.shape[2]
        out = inner(first, watched)
        if out is not None:
            self.keys[watched.layer] += watched.query.shape[2]
        return out


class _StepLogits:
    """A streamer proxy that hands the caller's streamer, before each put of new tokens ``[B]``, the raw
    logits ``[B, V]`` they were chosen from (a live ``logprobs`` stream needs them; ``generate`` keeps its
    own in a local). Token 0 comes from the prefill's logits, token ``k`` from the ``k``-th decode forward."""

    def __init__(self, streamer: Any, run: dict[str, object]) -> None:
        self.streamer, self.run, self.puts = streamer, run, -1  # the first put echoes the history

    def put(self, value: torch.Tensor) -> None:
        if self.puts >= 0:
            recorder: Recorder = self.run["recorder"]  # type: ignore[assignment]
            prefilled: State = self.run["state"]  # type: ignore[assignment]
            logits = prefilled.last_logits if self.puts == 0 else recorder.forwards[self.puts - 1].logits
            self.streamer.put_logits(logits)
        self.puts += 1
        self.streamer.put(value)

    def end(self) -> None:
        self.streamer.end()


def _with_step_logits(kwargs: Mapping[str, Any], run: dict[str, object]) -> Mapping[str, Any]:
    """``kwargs`` with a streamer that has ``put_logits`` wrapped in ``_StepLogits``."""
    streamer = kwargs.get("streamer")
    if not callable(getattr(streamer, "put_logits", None)):
        return kwargs
    return {**kwargs, "streamer": _StepLogits(streamer, run)}


@contextmanager
def _refused_at_entry(run: dict[str, object]) -> Iterator[None]:
    """A bare ``ValueError`` from ``generate`` before its first forward (``run`` still empty: ``prefill`` never ran)
    is an option transformers refused as it started (``GenerationConfig.validate``, a logits processor's
    arguments): ``GenerationOptionError``. Nothing was fed, so the caller's state is untouched."""
    try:
        yield
    except ValueError as exc:
        if run or isinstance(exc, KVStateError):
            raise
        raise GenerationOptionError("generate refused an option before any forward",
                                    found=f"{type(exc).__name__}: {exc}"[:300],
                                    fix="correct the option named above; nothing ran and the state is unchanged"
                                    ) from exc


def _room(options: GenerateOptions, history: int) -> int:
    """Decode slots ``generate`` may append after a history of ``history`` tokens (as ``finish_reasons`` counts
    them), at least 1; a longer answer than that (a stopping criterion's choice) grows the room."""
    config = options.config
    n = config.max_new_tokens if config.max_new_tokens is not None else (config.max_length or 0) - history
    return max(1, min(int(n), 1 << 16))


MAX_PACKED = 2048  # rows of one packed prefill forward: its activations stay small


def _groups(items: list, limit: int) -> list[list]:
    """``items`` (``(run, chunk)``) in consecutive groups of at most ``limit`` chunk rows (one item at least)."""
    groups: list[list] = []
    rows = limit
    for item in items:
        n = item[1][0].shape[1]
        if rows + n > limit:
            groups.append([])
            rows = 0
        groups[-1].append(item)
        rows += n
    return groups


def _mask_arg(mask: torch.Tensor) -> torch.Tensor | None:
    """Drop an all-ones mask, as ``generate`` does, so both paths run the same kernels."""
    return None if bool(mask.all()) else mask.long()
