"""The one thread that runs the model: a bounded queue of requests over one ``kvstate.batch.Scheduler``.

What runs in parallel: HTTP parsing, authentication, chat rendering, tokenization and streaming to clients
run on the server's event loop, for any number of requests at once. Model work runs here, on one thread, in
the scheduler's steps: at each step boundary the thread takes the requests that arrived, drops those whose
clients left, admits waiting prompts (their prefill) and runs one decode step for every running answer,
handing each token to its request's ``streaming.Streamer``. ``Settings.batching.max_batch`` answers decode
together: with 1 (a CPU's default) requests run one at a time, in arrival order, on ``Session``'s own kernels;
with more they share forwards, and each answer is still bit for bit what it gets alone (``docs/batching.md``).
A request whose options the scheduler's sampler cannot serve runs through ``Session.generate`` between two
steps, alone (``kvstate.serve.alone``). A request that finds ``max_queue`` jobs waiting or running gets a 429.

Every request resumes from its namespace of the ``StatePool`` and its store (``kvstate.resume`` picks among
them); its prompt's state and, after the answer, the conversation's are offered back to both, and the reply is
settled into canonical chunks when the model is idle (``kvstate.serve.settle``). A cancelled request (the
client went away) leaves at the next step and commits nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..batch import BatchRequest, Done, Failed, Scheduler, Token
from ..batch.scheduler import Completion
from ..protocols import PrefixCache, PrefixQuery
from ..resume import offer
from ..settings import Settings
from .alone import Halt, StopCriteria, generate_alone, refused
from .batching import batch_request
from .chat import Prompt
from .errors import HTTPError
from .logprobs import TokenLogprob, build, compute
from .metrics import Clock, Metrics
from .params import Request
from .pool import StatePool
from .settle import Settler
from .streaming import Cancelled, Streamer

__all__ = ["Cancelled", "Host", "Job", "Result", "Runner", "shutting_down"]

GATHER_CAP = 10  # a burst is gathered for at most this many quiet gaps (``Runner._gather``)


def shutting_down() -> HTTPError:
    """The 503 of a request that a draining server will not start (``Runner.stop_accepting``)."""
    return HTTPError("the server is shutting down", status=503, code="server_shutting_down",
                     fix="retry on another replica, or once this one is back", headers={"Retry-After": "5"})


@dataclass(eq=False)
class Job:
    """One request's work. ``on_text`` (called on the model thread) receives answer text as it is final."""

    namespace: str
    prompt: Prompt
    request: Request
    inputs: dict[str, Any] = field(default_factory=dict)
    on_text: Callable[[str], None] | None = None
    # with logprobs: receives each token's piece of the answer and its logprobs as the piece is final
    on_token: Callable[[str, TokenLogprob], None] | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    # the canonical schedule's marks for this prompt (None: the runner's): a chat's turn marks, a raw prompt's
    # prompt marks (``kvstate.schedule``)
    marks: tuple[int, ...] | None = None
    clock: Clock = field(default_factory=Clock)  # its times, for ``Metrics`` (arrival: when the job is made)


@dataclass(frozen=True)
class Result:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    seconds: float
    logprobs: tuple[TokenLogprob, ...] | None = None  # when the request asked for them


class Host(Protocol):
    """What the runner needs of its server: the model, the pool, each namespace's store, the metrics, and the ids
    the next turn of a reply begins with (``following``: None where no template renders them)."""

    model: Any
    tokenizer: Any
    pool: StatePool
    metrics: Metrics

    def store_for(self, namespace: str) -> PrefixCache | None: ...

    def following(self, prompt: Prompt, text: str) -> list[int] | None: ...


class _Active:
    """A job inside the scheduler: its future, its streamer and when it started."""

    def __init__(self, job: Job, future: concurrent.futures.Future[Result], streamer: Streamer) -> None:
        self.job, self.future, self.streamer = job, future, streamer
        self.started = time.perf_counter()
        self.halted = False  # ended by the shutdown deadline (``Runner.halt``)


class Runner:
    """Runs ``Job`` s on the host's model (see the module docstring); ``gather``: seconds of quiet that end a burst
    of arrivals at an idle model (``_gather``)."""

    def __init__(self, host: Host, settings: Settings, max_queue: int = 16, gather: float = 0.02) -> None:
        from ..adapters.fingerprinting import fingerprint

        self.host, self.settings, self.max_queue, self.gather = host, settings, max_queue, gather
        self.fingerprint = fingerprint(host.model, host.tokenizer)
        # prefixes are shared through each key's pool namespace (and store), never across keys
        self.scheduler = Scheduler(host.model, replace(settings, batching=replace(settings.batching,
                                                                                  share_prefixes=False)),
                                   fingerprint=self.fingerprint)
        self.settler = Settler(host.model, host.pool, settings, self.fingerprint, self._idle_for, host.store_for)
        self.stops = StopCriteria(host.tokenizer)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstate-model")
        self._inbox: deque[tuple[Job, concurrent.futures.Future[Result]]] = deque()
        self._active: dict[int, _Active] = {}
        self._looping = False
        self._pending = 0
        self._jobs: set[Job] = set()  # queued or running, so close() can cancel them
        self._arrived = threading.Event()  # set by every submit: a settle waiting for its grace yields
        self._closing = False
        self._draining = False  # a graceful stop began: no new job is accepted (``stop_accepting``)
        self._halted = threading.Event()  # its deadline passed: running answers end at their next token (``halt``)
        self._lock = threading.Lock()
        self.peak = 0  # the most requests that ever decoded together

    @property
    def pending(self) -> int:
        """Jobs waiting or running."""
        return self._pending

    def submit(self, job: Job) -> concurrent.futures.Future[Result]:
        """Queue ``job``; a full queue is a 429 (a draining server a 503) before anything is queued."""
        future: concurrent.futures.Future[Result] = concurrent.futures.Future()
        with self._lock:
            self._count(job)
            self._inbox.append((job, future))
            self._arrived.set()
            start, self._looping = not self._looping, True
        future.add_done_callback(lambda _: self._done(job))
        if start:
            self._executor.submit(self._loop)
        return future

    def drain(self) -> None:
        """Wait until the work queued so far, replies and their settling included, has run."""
        self._executor.submit(lambda: None).result()

    def stop_accepting(self) -> None:
        """Begin a graceful stop: new jobs get a 503, queued and running ones go on, and no reply is settled
        while they do (``settle_pending`` settles the rest into the store at the end)."""
        with self._lock:
            self._draining = True
        self._arrived.set()  # a settle waiting for its grace returns

    def settle_pending(self) -> None:
        """At the end of a graceful stop (no request left): settle the replies still waiting and write them to the
        store (``Settler.settle_all``). Nothing past the shutdown deadline (``halt``): the operator is waiting."""
        if self._halted.is_set():
            return
        with contextlib.suppress(RuntimeError):  # the executor was shut down already: nothing can run
            self._executor.submit(self.settler.settle_all).result()

    def halt(self) -> None:
        """End every running answer at its next token, as a length limit would (``finish_reason`` ``length``,
        its state kept and offered to the pool and the store); jobs not started yet get a 503."""
        self._halted.set()
        self._arrived.set()

    def close(self) -> None:
        """Cancel what is queued or running (each stops at its next token, committing nothing) and wait."""
        with self._lock:
            for job in self._jobs:
                job.cancelled.set()
            self._closing = True
        self._arrived.set()  # a settle waiting for its grace returns, and no other starts
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._lock:  # jobs whose loop never started (the executor dropped it)
            left, self._inbox = list(self._inbox), deque()
        for _, future in left:
            future.set_exception(Cancelled())

    # ----- the queue -----------------------------------------------------------------------------------
    def _count(self, job: Job) -> None:
        """Count ``job`` as waiting or running, or raise the 429 of a full queue (holds ``_lock``)."""
        if self._draining:
            raise shutting_down()
        if self._pending >= self.max_queue:
            raise HTTPError(f"the server is busy: {self._pending} requests are queued or running "
                            f"(limit {self.max_queue})", status=429, code="rate_limit_exceeded",
                            fix="retry after a moment", headers={"Retry-After": "1"})
        self._pending += 1
        self._jobs.add(job)
        self.host.metrics.queued(job.clock)

    def _done(self, job: Job) -> None:
        with self._lock:
            self._pending -= 1
            self._jobs.discard(job)
        self.host.metrics.released(job.clock)

    def _idle_for(self, seconds: float) -> bool:
        """Whether no request arrives (and the runner is not closing or draining) within ``seconds``."""
        self._arrived.clear()  # before reading the flags: a submit or close after this sets it again
        return not (self._busy() or self._arrived.wait(seconds) or self._busy())

    def _busy(self) -> bool:
        return bool(self._pending) or self._closing or self._draining

    # ----- the model thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Steps while anything waits or runs; then settles the waiting replies and returns the thread."""
        while True:
            self._gather()
            with self._lock:
                new = list(self._inbox)
                self._inbox.clear()
                if not new and not self.scheduler.busy:
                    self._looping = False
                    break
            for job, future in new:
                self._take(job, future)
            for handle, active in self._active.items():
                if active.job.cancelled.is_set():
                    self.scheduler.cancel(handle)
                elif self._halted.is_set() and not active.halted:  # ends at the step boundary, state kept
                    active.halted = True
                    self.scheduler.stop(handle)
            self.peak = max(self.peak, self.scheduler.running)
            try:
                for event in self.scheduler.stepping():
                    self._dispatch(event)
            except Exception as exc:  # a shared forward failed: every running request fails with it
                logging.getLogger("kvstate.serve").error("a model step failed", exc_info=True)
                self._fail_all(exc)
            self._admitted()
        self.settler.settle_idle()

    def _gather(self) -> None:
        """At an idle model, let a burst of requests arrive before the first step: clients that send together
        (one per user of an app, a benchmark's streams) otherwise get the first request prefilled and decoded
        alone while the rest queue behind that step. Waits while requests keep arriving less than ``gather``
        apart (at most ``GATHER_CAP`` gaps), never past a full batch; a lone request pays one ``gather``. Busy,
        nothing waits: arrivals join at the next step boundary."""
        if self.gather <= 0 or self.scheduler.busy:
            return
        for _ in range(GATHER_CAP):
            with self._lock:  # nothing arrived (the loop is about to end): nothing to gather for
                if not self._inbox or len(self._inbox) >= self.settings.batching.max_batch or self._closing:
                    return
                self._arrived.clear()  # a submit after this sets it again
            if not self._arrived.wait(self.gather):
                return

    def _take(self, job: Job, future: concurrent.futures.Future[Result]) -> None:
        """Hand ``job`` to the scheduler, or run it alone now when its options are not the sampler's."""
        if job.cancelled.is_set():
            future.set_exception(Cancelled())
            return
        if self._halted.is_set():
            future.set_exception(shutting_down())
            return
        self.settler.settle_for(job.namespace, job.prompt.ids)  # the scheduler resumes from that settle
        try:
            request = self._request(job)
        except Exception as exc:
            future.set_exception(refused(exc) if _refused(exc) else exc)
            return
        if request is None:
            try:
                future.set_result(self._alone(job))
            except Exception as exc:
                future.set_exception(exc)
            return
        handle = self.scheduler.submit(request)
        self._active[handle] = _Active(job, future, Streamer(self.host.tokenizer, job, self.host.metrics))

    def _admitted(self) -> None:
        """Tell ``Metrics`` which requests the scheduler admitted (``Metrics.started``: the end of their queue time,
        seen at their first event or at the end of the step that admitted them)."""
        for handle, active in self._active.items():
            if active.job.clock.started is None and self.scheduler.admitted(handle):
                self.host.metrics.started(active.job.clock)

    def _request(self, job: Job) -> BatchRequest | None:
        """``job`` as the scheduler's request (None: its options run alone); its stop strings checked as
        ``generate`` checks them."""
        options = job.request.options
        if options.get("stop_strings"):
            self.stops.get(tuple(options["stop_strings"]))
        request = batch_request(self.host.model, job.prompt.ids, options, job.request.seed, job.request.logprobs)
        if request is None:
            return None
        return replace(request, inputs=job.inputs, sources=self._sources(job), marks=self._marks(job))

    def _alone(self, job: Job) -> Result:
        """``job`` through ``Session.generate`` now, between two steps (``kvstate.serve.alone``)."""
        from ..session import Session

        self.host.metrics.started(job.clock)
        started = time.perf_counter()
        settings = replace(self.settings, canonical_marks=self._marks(job))
        session = Session(self.host.model, sources=self._sources(job), fingerprint=self.fingerprint,
                          settings=settings)
        streamer, halt = Streamer(self.host.tokenizer, job, self.host.metrics), Halt(self._halted)
        outcome = generate_alone(session.run, job.prompt.ids, {**job.request.options, **job.inputs},
                                 job.request.seed, streamer, halt, self.stops)
        tokens = outcome.tokens[0].tolist()
        text, stopped = streamer.final(tokens)
        self._defer_settle(job, outcome.state, text)
        finish = "stop" if stopped else "length" if halt.fired else outcome.finish_reason[0]
        k = job.request.logprobs
        logprobs = streamer.logprobs if k is None or streamer.complete else \
            compute(outcome.output.logits, tokens, k, self.host.tokenizer, text)  # type: ignore[attr-defined]
        return self._result(job, text, finish, len(tokens), outcome.reused, started, logprobs)

    def _dispatch(self, event: Token | Done | Failed) -> None:
        active = self._active.get(event.handle)
        if active is None:
            return
        self.host.metrics.started(active.job.clock)  # its first event: admitted (a no-op after that)
        if isinstance(event, Token):
            try:
                active.streamer.add(event.choice.token, (event.choice.logprob, event.choice.top))
            except Cancelled:
                self.scheduler.cancel(event.handle)
                return
            if active.streamer.stopped:
                self.scheduler.stop(event.handle)  # the answer is complete; it keeps its state, as generate's stop
        elif isinstance(event, Done):
            del self._active[event.handle]
            self._finish(active, event.completion)
        else:  # the request's own mistake is a 400, as generate's; anything else a 500
            del self._active[event.handle]
            active.future.set_exception(refused(event.error) if _refused(event.error) else event.error)

    def _finish(self, active: _Active, completion: Completion) -> None:
        job = active.job
        if completion.finish_reason == "cancelled":  # a halted request still waiting for its prompt: not started
            active.future.set_exception(shutting_down() if active.halted else Cancelled())
            return
        tokens = list(completion.tokens)
        text, stopped = active.streamer.final(tokens)
        # the halt stops a request at a step boundary, before that step's tokens: no end id came with it
        finish = "stop" if stopped else "length" if active.halted else completion.finish_reason
        if completion.state is not None:
            self._offer(job, completion.state)
            self._defer_settle(job, completion.state, text)
        k = job.request.logprobs
        logprobs = active.streamer.logprobs if k is None or active.streamer.complete else build(
            tokens, lambda i: (completion.logprobs[i], completion.top_logprobs[i]), self.host.tokenizer, text)
        result = self._result(job, text, finish, len(tokens), completion.reused, active.started, logprobs)
        active.future.set_result(result)

    def _fail_all(self, exc: Exception) -> None:
        for handle in self.scheduler.abort():
            active = self._active.pop(handle, None)
            if active is not None:
                active.future.set_exception(exc)

    # ----- what every answer shares ------------------------------------------------------------------------
    def _marks(self, job: Job) -> tuple[int, ...]:
        return self.settings.canonical_marks if job.marks is None else job.marks

    def _sources(self, job: Job) -> tuple[PrefixCache, ...]:
        """Where ``job`` resumes from, and what its states are offered to: its namespace's pool, then its store."""
        store = self.host.store_for(job.namespace)
        return (self.host.pool.source(job.namespace, self._marks(job)), *(() if store is None else (store,)))

    def _offer(self, job: Job, state: Any) -> None:
        """Offer the conversation's state after a scheduled answer to its pool and store, as ``Session.run`` offers
        it (its prompt's state was offered when it was admitted)."""
        query = PrefixQuery(self.fingerprint, state.tokens.cpu(), tuple((m.start, m.digest) for m in state.media))
        offer(self._sources(job), (state,), query, self.scheduler.engine.seconds_per_token)

    def _defer_settle(self, job: Job, state: Any, text: str) -> None:
        """Queue the settle of ``job``'s reply ``text``, through the ids its next turn begins with where marks make
        that useful (a turn or a line starts right after them)."""
        through = None
        if self._marks(job):
            try:
                through = self.host.following(job.prompt, text)
            except Exception:  # an optimisation: without it the next turn re-feeds the answer itself
                logging.getLogger("kvstate.serve").warning("rendering the next turn's history failed", exc_info=True)
        self.settler.defer(job.namespace, state, through, self._marks(job))

    def _result(self, job: Job, text: str, finish: str, tokens: int, reused: int, started: float,
                logprobs: tuple[TokenLogprob, ...] | None) -> Result:
        result = Result(text, finish, len(job.prompt.ids), tokens, reused, time.perf_counter() - started, logprobs)
        self.host.metrics.finished(job.clock, result)
        return result


def _refused(error: BaseException) -> bool:
    """Whether ``error`` is the request's own (generation options transformers or kvstate refused: a 400)."""
    return isinstance(error, (ValueError, TypeError)) and not isinstance(error, HTTPError)
