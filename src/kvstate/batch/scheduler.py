"""Continuous batching: many conversations decode together, each answer bit for bit what it gets alone.

``Scheduler`` keeps a FIFO of waiting requests and a set of running streams, and works in
steps. At each step boundary it drops cancelled requests, admits waiting ones while fewer
than ``max_batch`` run, then runs one decode step for every running stream:

* **admission** plans each request as a ``Session`` with the scheduler's ``prefill_rows`` does
  (``Session.take_prefix``: its prefix sources, validation), feeds the rest of every history
  admitted in the step together (``Session.extend_many``: the chunks of a round in one tiled
  forward, each chunk with the bits it gets alone; ``kvstate.engine.batched.prefill``), then runs
  ``Session.run`` on each history, which finds it fed and picks the first token from its logits.
  So the prefilled ``State`` is that ``Session``'s bit for bit. Media prompts and non-canonical
  feeds run ``Session.run`` alone. A prompt that shares a whole chunk with one admitted in the
  same step waits a step and resumes from that one's state (a shared system prompt is computed
  once). With ``prefill_tokens``, a history longer than that is fed in pieces that end at cuts of
  the schedule, about ``prefill_tokens`` tokens a step: the same forwards, spread over steps, so one
  long prompt never holds the running streams for its whole prefill;
* **a decode step** feeds every stream's last token in one packed forward (attention-only
  families) or one forward per stream (the rest; ``kvstate.engine.batched.decode``) and picks each
  stream's next token with its own ``Sampler``.

Why a row is what it is alone: a prompt's chunk is tiled and attends per prompt; a packed forward has
a fixed tile shape, its matrix products run per tile and its attention per stream
(``docs/batching.md`` has the measurements); sampling sees one row and one generator. A
finished request's ``Completion`` carries its tokens, log-probabilities and its ``State`` after
the answer (history plus every new token but the last, as ``Session.generate`` leaves it), which
a ``Session`` continues like any other state.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..adapters.fingerprinting import unchanged
from ..engine import Engine
from ..engine.batched.decode import Packed, Single, Stream, Unpackable, packable
from ..errors import InputError
from ..options import end_ids
from ..protocols import PrefixCache
from ..request import check_given, check_marks
from ..schedule import default_chunk
from ..settings import Batching, Settings
from ..state import State
from .events import MAX_TOP_LOGPROBS, BatchRequest, Completion, Done, Event, Failed, Token
from .prefixes import RecentPrompts
from .sampling import Choice, Sampler, rows_logprobs

__all__ = ["MAX_TOP_LOGPROBS", "BatchRequest", "Completion", "Done", "Event", "Failed", "Scheduler", "Token",
           "batch_settings", "generate_many"]


class _Job:
    def __init__(self, handle: int, request: BatchRequest, sampler: Sampler, stops: frozenset[int]) -> None:
        self.handle, self.request, self.sampler, self.stops = handle, request, sampler, stops
        self.choices: list[Choice] = []
        self.stream: Stream | None = None
        self.decoder: Packed | Single | None = None
        self.prefilled: State | None = None
        self.reused = 0
        self.session: Any = None  # a history fed in pieces: its Session, the ids [1, L], the cuts left
        self.ids: torch.Tensor | None = None
        self.cuts: deque[int] = deque()
        self.end: int | None = None  # the history's length for a canonical feed (None: Session.run feeds it)


class Scheduler:
    """Continuous batching on one model (see the module docstring).

    Args:
        model: a transformers causal LM kvstate supports.
        settings: how it feeds, plans and batches (``kvstate.settings.Settings``, its ``batching`` the scheduler's
            own; ``batch_settings`` makes one from keywords). None: ``batch_settings(model)``.
        sources: prefix caches every request resumes from (after its own), as for ``Session``.
        tokenizer, fingerprint: hashed into the states' fingerprint (``kvstate.fingerprint(model, tokenizer)``),
            or that fingerprint computed once by the caller.
    """

    def __init__(self, model: torch.nn.Module, settings: Settings | None = None, *,
                 sources: Sequence[PrefixCache] = (), tokenizer: object | None = None, fingerprint: Any = None) -> None:
        from ..adapters.fingerprinting import fingerprint as digest
        from ..selfcheck import bind

        self.settings = batch_settings(model) if settings is None else check_given(settings, Settings, {}, {})
        self.model, batching = model, self.settings.batching
        self.sources = (*sources, *((RecentPrompts(batching.max_batch),) if batching.share_prefixes else ()))
        self.fingerprint = fingerprint or digest(model, tokenizer)
        self.engine = Engine(bind(model))
        s = self.settings
        self._packed = Packed(self.engine, batching.rows, s.invariant, s.prepack, fixed=batching.static_shapes)
        self._single = Single(self.engine, s)
        self._handles = itertools.count()
        self._waiting: deque[_Job] = deque()
        self._feeding: deque[_Job] = deque()  # admitted; their histories are fed in pieces (FIFO)
        self._running: list[_Job] = []
        self._cancelled: set[int] = set()
        self._stopping: set[int] = set()

    @property
    def busy(self) -> bool:
        """Requests wait or run."""
        return bool(self._waiting or self._feeding or self._running)

    @property
    def canonical_chunk(self) -> int:
        """``C`` of the scheduler's schedule (0: off), as ``Session.canonical_chunk``."""
        return self.settings.canonical_chunk

    @property
    def running(self) -> int:
        return len(self._running)

    def admitted(self, handle: int) -> bool:
        """Whether request ``handle`` left the waiting line: its prompt is being fed, or it decodes (or ended)."""
        return all(job.handle != handle for job in self._waiting)

    @property
    def packing(self) -> bool:
        """Whether attention-only conversations share decode forwards on this model: False once the model
        refused a packed forward (it asked for one sequence length, or attends outside transformers'
        attention interface); they then decode one per forward, still alone-equal."""
        return self._packed.usable

    def submit(self, request: BatchRequest) -> int:
        """Queue ``request``; it is admitted at a step boundary. Returns its handle."""
        if not isinstance(request, BatchRequest):
            raise InputError("Scheduler.submit takes a BatchRequest", expected="BatchRequest",
                             found=type(request).__name__, fix="wrap the ids in kvstate.batch.BatchRequest")
        device = next(self.model.parameters()).device
        stops = end_ids(getattr(self.model, "generation_config", None)) if request.stop_ids is None \
            else frozenset(request.stop_ids)
        history = torch.as_tensor(request.ids).reshape(-1).tolist() if request.processors else ()
        sampler = Sampler(request.sampling, request.top_logprobs, device, request.processors, history)
        job = _Job(next(self._handles), request, sampler, stops)
        self._waiting.append(job)
        return job.handle

    def cancel(self, handle: int) -> None:
        """Drop request ``handle`` at the next step boundary (its ``Done`` says ``cancelled``, with no state)."""
        self._cancelled.add(handle)

    def stop(self, handle: int) -> None:
        """End request ``handle``'s answer at the next step boundary, as a stop id would (``Done`` says
        ``stop`` and carries the state): a server that found a stop string in the text."""
        self._stopping.add(handle)

    def abort(self) -> list[int]:
        """Drop every waiting and running request without events (after a failed step); their handles."""
        jobs = [*self._waiting, *self._feeding, *self._running]
        for job in self._running:
            job.decoder.close(job.stream)  # type: ignore[union-attr, arg-type]
        self._waiting.clear()
        self._feeding.clear()
        self._running.clear()
        return [job.handle for job in jobs]

    def run(self) -> Iterator[Event]:
        """Steps until nothing waits or runs, yielding each event as soon as it happens."""
        while self.busy:
            yield from self.stepping()

    def step(self) -> list[Event]:
        """Drop cancelled requests, admit waiting ones, then one decode step for every running stream."""
        return list(self.stepping())

    def stepping(self) -> Iterator[Event]:
        """``step``, yielding each event as soon as it happens (the first tokens right after the prefill)."""
        events = self._stepping()
        try:
            while True:
                # between two events nothing of the step edits the weights: its sessions' verbs check them
                # once (a caller may edit them while it holds an event: the next stretch walks them again)
                with unchanged(self.model):
                    event = next(events, None)
                if event is None:
                    return
                yield event
        finally:
            events.close()  # a caller that stops reading ends the step where it stood, as before

    def _stepping(self) -> Iterator[Event]:
        yield from self._ends()
        # waiting prompts first, so a short one never waits for another's long history; then the histories
        # being fed, the oldest one piece at least (none starves): a step feeds the budget plus one chunk.
        # Text prompts and pieces are fed together after admission (``_prefill``: packed where tiled)
        spent, started, work = 0, set(), []  # prompt tokens fed; histories whose first piece it fed; (job, end)
        while self._waiting and len(self._running) + len(self._feeding) + len(work) < self.settings.batching.max_batch \
                and self._room(spent):
            job = self._waiting[0]
            try:
                pieces = self._pieces(job, spent)
                if not pieces and self._start(job, work):  # it shares a chunk with a prompt fed in this step:
                    break  # next step, it resumes from that prompt's state (computed once)
            except Exception as exc:  # the request's own input failed: the batch goes on without it
                self._waiting.popleft()
                yield Failed(job.handle, exc)
                continue
            self._waiting.popleft()
            if pieces:
                self._feeding.append(job)
                started.add(job.handle)
                spent += self._piece(job, spent, work)
                continue
            spent += torch.as_tensor(job.request.ids).shape[-1]
            if job.session is not None:
                work.append((job, job.end))
                continue
            try:
                choice = self._admit(job)
            except Exception as exc:
                yield Failed(job.handle, exc)
                continue
            yield from self._took(job, choice)
        for k, job in enumerate(j for j in list(self._feeding) if j.handle not in started):
            if k and not self._room(spent):
                break
            spent += self._piece(job, spent, work)
        yield from self._prefill(work)
        for decoder in (self._packed, self._single):
            ending = self._cancelled | self._stopping  # asked during this step: they sit its decode out
            jobs = [j for j in self._running if j.decoder is decoder and j.handle not in ending]
            if jobs:  # every choice is recorded before the first event goes out: a caller may stop reading
                rows, logprobs = rows_logprobs(self._decode(decoder, jobs))
                events = [e for i, job in enumerate(jobs) for e in self._took(job, job.sampler.choose(rows[i],
                                                                                                      logprobs[i]))]
                yield from events

    # ----- internals -----------------------------------------------------------------------------
    def _room(self, spent: int) -> bool:
        """Whether this step may feed more prompt tokens after ``spent``."""
        budget = self.settings.batching.prefill_tokens
        return budget is None or spent == 0 or spent < budget

    def _marks(self, request: BatchRequest) -> tuple[int, ...]:
        """The canonical marks ``request``'s history is fed with: its own, or the scheduler's."""
        return self.settings.canonical_marks if request.marks is None else request.marks

    def _session(self, request: BatchRequest) -> Any:
        from ..session import Session

        settings = replace(self.settings, canonical_marks=self._marks(request))
        return Session(self.model, state=request.state, sources=(*request.sources, *self.sources),
                       fingerprint=self.fingerprint, settings=settings)

    def _pieces(self, job: _Job, spent: int) -> bool:
        """Whether ``job``'s history is fed in pieces: text longer than this step may feed. Its session then
        takes the longest prefix a source holds (``Session.take_prefix``), and ``job.cuts`` are the chunk ends
        the engine would feed the rest with: none where that feed does not follow the canonical schedule (a
        compressed state, one-token-per-forward families...), whose chunks pieces would change, so the rest
        then runs at once (``job.end`` None)."""
        request, budget = job.request, self.settings.batching.prefill_tokens
        ids = torch.as_tensor(request.ids, dtype=torch.long).reshape(1, -1)
        if budget is None or ids.shape[1] <= budget - spent or request.inputs:
            return False
        cuts = self._take(job)
        job.cuts = deque(cuts[:-1] if cuts else ())
        return True

    def _start(self, job: _Job, work: list[tuple[_Job, int | None]]) -> bool:
        """Plan a text prompt admitted whole: its session takes the longest prefix a source holds, and the rest
        is fed with this step's other prompts (``job.end``: the history's length; None where that feed does not
        follow the canonical schedule: ``Session.run`` then feeds it alone). True (nothing admitted) when one of
        its chunks is a chunk of a prompt in ``work``: the next step resumes from that prompt's state."""
        if job.request.inputs:  # media: ``Session.run`` with the pixels
            return False
        cuts = self._take(job)
        if cuts is None:
            return False
        for other, _ in work:
            if self._marks(other.request) != self._marks(job.request):  # other chunks: nothing to resume from
                continue
            a, b = job.ids[0], other.ids[0]  # type: ignore[index]
            n = min(a.shape[0], b.shape[0])
            same = a[:n] == b[:n]
            common = n if bool(same.all()) else int(same.int().argmin())
            if cuts[0] <= common:
                return True
        return False

    def _take(self, job: _Job) -> list[int] | None:
        """``job``'s session, its history ``[1, L]`` and the prefix a source holds; the canonical chunk ends of
        the rest (None: not a canonical feed; ``job.end`` then None, else ``L``)."""
        ids = torch.as_tensor(job.request.ids, dtype=torch.long).reshape(1, -1)
        job.session, job.ids = self._session(job.request), ids.to(next(self.model.parameters()).device)
        job.reused = T = job.session.take_prefix(job.ids)
        settings = replace(self.settings, canonical_marks=self._marks(job.request))
        cuts = self.engine.canonical_cuts(job.session.state, job.ids[:, T:], settings)
        job.end = None if cuts is None else ids.shape[1]
        return cuts

    def _piece(self, job: _Job, spent: int, work: list[tuple[_Job, int | None]]) -> int:
        """Plan ``job``'s next piece into ``work``: one cut at least, then every cut within this step's tokens,
        or, when the rest fits or no cut is left, the rest of its history. Returns the tokens it feeds."""
        session, ids = job.session, job.ids
        assert session is not None and ids is not None
        T, L = session.state.tokens_seen, ids.shape[1]
        left = (self.settings.batching.prefill_tokens or L) - spent
        end: int | None = job.end
        if job.cuts and left < L - T:
            end = job.cuts.popleft()
            while job.cuts and job.cuts[0] - T <= left:
                end = job.cuts.popleft()
        work.append((job, end))
        return (end or L) - T

    def _prefill(self, work: list[tuple[_Job, int | None]]) -> Iterator[Event]:
        """Feed every planned piece (``Session.extend_many``: one packed forward a round where the prefill
        tiles allow), then start the jobs whose whole history is in (their first token from the prompt's
        logits). A failure fails its own request only."""
        feeds = [(job, end) for job, end in work if end is not None and end > job.session.state.tokens_seen]
        failed = self._extend(feeds)
        for job, end in work:
            if end is not None and end < job.ids.shape[1] and job.handle not in failed:  # type: ignore[union-attr]
                continue  # a piece: the history goes on in a later step
            if job in self._feeding:
                self._feeding.remove(job)
            if job.handle in failed:
                yield Failed(job.handle, failed[job.handle])
                continue
            try:
                choice = self._first(job, job.session, job.ids)
            except Exception as exc:  # a failed run commits nothing of the request; the batch goes on
                yield Failed(job.handle, exc)
                continue
            yield from self._took(job, choice)

    def _extend(self, feeds: list[tuple[_Job, int]]) -> dict[int, Exception]:
        """Feed each job's history up to ``end``, together where the jobs share their schedule's marks; where that
        fails, each alone (so only the failing requests fail). Returns the failures by handle."""
        from ..session import Session

        def piece(job: _Job, end: int) -> torch.Tensor:
            return job.ids[:, job.session.state.tokens_seen:end]  # type: ignore[index]

        groups: dict[tuple[int, ...], list[tuple[_Job, int]]] = {}
        for job, end in feeds:
            groups.setdefault(self._marks(job.request), []).append((job, end))
        failed: dict[int, Exception] = {}
        for group in groups.values():
            try:
                Session.extend_many([job.session for job, _ in group], [piece(job, end) for job, end in group])
            except Exception:
                for job, end in group:
                    try:
                        job.session.extend(piece(job, end))
                    except Exception as exc:
                        failed[job.handle] = exc
        return failed

    def _decode(self, decoder: Packed | Single, jobs: list[_Job]) -> torch.Tensor:
        """One decode step of ``jobs``: their logits ``[n, V]``. A model that refuses its first packed forward
        decodes them one per forward from then on (their prefilled states are untouched)."""
        streams, tokens = [j.stream for j in jobs], [j.choices[-1].token for j in jobs]
        try:
            return decoder.step(streams, tokens)  # type: ignore[arg-type]
        except Unpackable:
            for job in jobs:
                job.decoder = self._single
            return self._single.step(streams, tokens)  # type: ignore[arg-type]

    def _admit(self, job: _Job) -> Choice:
        """Prefill ``job``'s history as ``Session`` does; the first token from the prompt's logits."""
        ids = torch.as_tensor(job.request.ids, dtype=torch.long)
        return self._first(job, self._session(job.request), ids[None] if ids.dim() == 1 else ids)

    def _first(self, job: _Job, session: Any, ids: torch.Tensor) -> Choice:
        """``session.run`` over the whole history ``ids`` ``[1, L]``; the job starts decoding from its state.
        After pieces, ``job.reused`` keeps what a source held before them (the pieces are this request's)."""
        request = job.request
        outcome = session.run(ids, max_new_tokens=1, do_sample=False, **dict(request.inputs))
        job.prefilled = outcome.prefilled
        job.reused = job.reused if job.session is not None else outcome.reused
        job.stream = Stream(outcome.prefilled, room=request.max_new_tokens)
        packs = self._packed.usable and packable(self.engine, outcome.prefilled)
        job.decoder = self._packed if packs else self._single
        self._running.append(job)  # only now: a refused request holds nothing
        return job.sampler.choose(outcome.prefilled.last_logits[0])  # type: ignore[index]

    def _took(self, job: _Job, choice: Choice) -> list[Event]:
        """Record ``choice``; finish the job when it ends the answer."""
        job.choices.append(choice)
        events: list[Event] = [Token(job.handle, choice)]
        if choice.token in job.stops:
            events.append(self._finish(job, "stop"))
        elif len(job.choices) >= job.request.max_new_tokens:
            events.append(self._finish(job, "length"))
        return events

    def _finish(self, job: _Job, reason: str) -> Done:
        self._running.remove(job)
        assert job.decoder is not None and job.stream is not None
        if reason == "cancelled":
            job.decoder.close(job.stream)
            state = None
        else:
            state = job.decoder.finish(job.stream)
        completion = Completion(tuple(c.token for c in job.choices), tuple(c.logprob for c in job.choices),
                                tuple(c.top for c in job.choices), reason, state, job.prefilled, job.reused)
        return Done(job.handle, completion)

    def _ends(self) -> Iterator[Done]:
        """``Done`` for the requests cancelled or stopped since the last step."""
        for queue in (self._waiting, self._feeding):
            for job in [j for j in queue if j.handle in self._cancelled | self._stopping]:
                queue.remove(job)
                yield Done(job.handle, Completion((), (), (), "cancelled", None, None, 0))
        for job in [j for j in self._running if j.handle in self._cancelled | self._stopping]:
            yield self._finish(job, "cancelled" if job.handle in self._cancelled else "stop")
        self._cancelled.clear()
        self._stopping.clear()


def batch_settings(model: torch.nn.Module, *, max_batch: int = 16, rows: int = 16, invariant: bool = True,
                   prepack: bool = True, prefill_rows: int = 32, prefill_tokens: int | None = None,
                   share_prefixes: bool = True, canonical_chunk: int | None = None, chunk_size: int = 512,
                   canonical_marks: Sequence[int] = (), static_shapes: bool = False) -> Settings:
    """A ``Scheduler``'s ``Settings`` from keywords, with its own defaults: prefill chunks in tiles of 32 rows, decode
    steps in tiles of 16. What each means: ``kvstate.settings.Settings`` and ``Batching`` (``rows``: the decode's
    tile; ``prefill_tokens``, ``share_prefixes``, ``static_shapes``, ``max_batch``: ``Batching``'s);
    ``canonical_chunk`` None: the device's default (``kvstate.schedule.default_chunk``)."""
    marks = check_marks(canonical_marks)
    chunk = default_chunk(marks, next(model.parameters()).device.type) if canonical_chunk is None else canonical_chunk
    batching = Batching(max_batch, rows, prefill_tokens, share_prefixes, static_shapes)
    return Settings(chunk_size, chunk, marks, prefill_rows=prefill_rows, prepack=prepack, invariant=invariant,
                    batching=batching)


def generate_many(model: torch.nn.Module, requests: Sequence[BatchRequest], *, sources: Sequence[PrefixCache] = (),
                  fingerprint: Any = None, **keywords: Any) -> list[Completion]:
    """Answer every request, batched (``Scheduler(model, batch_settings(model, **keywords))``); completions in
    request order."""
    scheduler = Scheduler(model, batch_settings(model, **keywords), sources=sources, fingerprint=fingerprint)
    handles = [scheduler.submit(r) for r in requests]
    done = {}
    for event in scheduler.run():
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Done):
            done[event.handle] = event.completion
    return [done[h] for h in handles]
