"""The one thread that runs the model: a bounded FIFO of generation jobs.

What runs in parallel: HTTP parsing, authentication, chat rendering, tokenization
and streaming to clients run on the server's event loop, for any number of
requests at once. Model work runs here, one request at a time, in arrival order,
with torch's intra-op threads inside each forward. There is no batching across
requests, so every answer is the answer its request would get alone. A request
that finds ``max_queue`` jobs waiting or running gets a 429 at once.

Each job builds a ``Session`` on the shared model whose prefix sources are its
namespace of the ``StatePool`` and its store (``kvstate.resume`` picks among them),
and runs it; the session offers the new state back to both. The outcome carries
the slots reused and the finish reason (and, when a request asks for logprobs, generate's raw
step logits, reduced here to ``logprobs.TokenLogprob`` s), so the runner only formats. A cancelled
job (the client went away) stops at its next token by raising from the streamer:
``Session.generate`` is transactional, so nothing of the cancelled call is kept anywhere.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..schedule import Canonical
from ..session import Session
from .chat import Prompt
from .errors import BadRequest, HTTPError
from .logprobs import Reporter, Step, TokenLogprob, compute, step_of
from .metrics import Metrics
from .params import Request
from .pool import StatePool


class Cancelled(Exception):
    """The client disconnected; the job stops without committing anything."""


def shutting_down() -> HTTPError:
    """The 503 of a request that a draining server will not start (``Runner.stop_accepting``)."""
    return HTTPError("the server is shutting down", status=503, code="server_shutting_down",
                     fix="retry on another replica, or once this one is back", headers={"Retry-After": "5"})


# How long an idle model waits before settling a reply: a client that sends its next request as soon as
# a reply ends gets it to the runner within a few ms here (rendering and tokenizing included)
SETTLE_GRACE = 0.05


@dataclass(eq=False)
class Job:
    """One request's work. ``on_text`` (called on the worker thread) receives answer text as it is final."""

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


@dataclass(frozen=True, eq=False)  # compared by identity: the deque removes this entry, not an equal one
class Unsettled:
    """A reply waiting for its settle: its conversation's ``namespace``, the ``state`` after it, and the ids the
    next turn begins with (``through``, None: settle the decoded tokens up to the last cut)."""

    namespace: str
    state: Any
    through: list[int] | None = None
    marks: tuple[int, ...] = ()  # the schedule the reply was fed with, and is settled with

    def continued_by(self, ids: list[int]) -> bool:
        """Whether a prompt of ``ids`` continues this reply: it begins with ``through`` (or the state's tokens)
        and goes on past them."""
        known = self._known()
        return len(ids) > len(known) and ids[:len(known)] == known

    def settles_for(self, ids: list[int], chunk: int) -> bool:
        """Whether, for a prompt of ``ids`` that continues this reply, settling first moves where its resume
        restarts: to the settle's end (a cut of the prompt's history), past the last cut before the reply's
        decoded tokens. Not when the prompt goes on inside the reply's last segment (a raw prompt that
        continues the answer's line): the settled slots would be fed again."""
        schedule, known = Canonical(chunk, marks=self.marks), len(self._known())
        return schedule.last_cut(known, ids=ids) > schedule.last_cut(min(self.state.canonical, known), ids=ids)

    def _known(self) -> list[int]:
        return list(self.through) if self.through is not None else self.state.tokens[0].tolist()


@dataclass(frozen=True)
class Result:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    seconds: float
    logprobs: tuple[TokenLogprob, ...] | None = None  # when the request asked for them


class Runner:
    """Runs ``Job`` s on one model, one at a time; ``store_for(namespace)`` gives each namespace's store."""

    def __init__(self, model: Any, tokenizer: Any, pool: StatePool, store_for: Callable[[str], Any],
                 metrics: Metrics, max_queue: int = 16, chunk_size: int = 512, canonical_chunk: int = 64,
                 canonical_marks: tuple[int, ...] = (), follow: Callable[[Job, str], Any] | None = None) -> None:
        from ..adapters.fingerprinting import fingerprint

        self.model, self.tokenizer, self.pool, self.store_for = model, tokenizer, pool, store_for
        self.metrics, self.max_queue, self.chunk_size = metrics, max_queue, chunk_size
        # turn marks: a settled answer ends where the next turn's cut is (``follow(job, text)``: those ids)
        self.canonical_chunk, self.canonical_marks, self.follow = canonical_chunk, canonical_marks, follow
        self.fingerprint = fingerprint(model, tokenizer)
        self.kernels: dict[str, Any] = {}  # Session's prefill kernels (BatchRunner: the scheduler's)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstate-model")
        self._pending = 0
        self._jobs: set[Job] = set()  # queued or running, so close() can cancel them
        # replies whose settle waits for an idle model (``_settle_idle``) or their conversation's next request
        # (``_settle_for``); past 16 the oldest is dropped. Read and written on the model thread only
        self._unsettled: deque[Unsettled] = deque(maxlen=16)
        self._arrived = threading.Event()  # set by every submit: a settle waiting for its grace yields
        self._closing = False
        self._draining = False  # a graceful stop began: no new job is accepted (``stop_accepting``)
        self._halted = threading.Event()  # its deadline passed: running answers end at their next token (``halt``)
        self._lock = threading.Lock()
        self._stops: dict[tuple[str, ...], Any] = {}  # StopStringCriteria by stop strings (``_stop_criterion``)

    @property
    def pending(self) -> int:
        """Jobs waiting or running."""
        return self._pending

    def submit(self, job: Job) -> concurrent.futures.Future[Result]:
        """Queue ``job``; a full queue is a 429 before anything is queued."""
        with self._lock:
            self._count(job)
        self._arrived.set()
        future = self._executor.submit(self._run, job)
        future.add_done_callback(lambda _: self._done(job))
        return future

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

    def drain(self) -> None:
        """Wait until the work queued so far, replies and their settling included, has run."""
        self._executor.submit(lambda: None).result()

    def stop_accepting(self) -> None:
        """Begin a graceful stop: new jobs get a 503, queued and running ones go on, and no reply is settled
        any more (the pool goes with the process)."""
        with self._lock:
            self._draining = True
        self._arrived.set()  # a settle waiting for its grace returns

    def halt(self) -> None:
        """End every running answer at its next token, as a length limit would (``finish_reason`` ``length``,
        its state kept and offered to the pool and the store); jobs not started yet get a 503."""
        self._halted.set()
        self._arrived.set()

    def _stop_criterion(self, stops: tuple[str, ...]) -> Any:
        """transformers' ``StopStringCriteria`` for ``stops``, built once: ``generate(stop_strings=...)`` builds
        it on every call, which reads and sorts the whole vocabulary (0.3 to 0.8 s a request for Gemma's
        262k tokens, more than the turn's forward). It holds tables only, so one serves every request, and
        ``generate`` ORs the criteria it is given with its own: the same stops as ``stop_strings``."""
        from transformers import StopStringCriteria

        with self._lock:
            found = self._stops.pop(stops, None) or StopStringCriteria(self.tokenizer, list(stops))
            self._stops[stops] = found  # the newest last; the oldest evicted past 16 stop sets
            while len(self._stops) > 16:
                self._stops.pop(next(iter(self._stops)))
        return found

    def _marks(self, job: Job) -> tuple[int, ...]:
        return self.canonical_marks if job.marks is None else job.marks

    def _through(self, job: Job, text: str) -> Any:
        """The ids the next turn begins with (``settle(through=...)``), when marks make that useful: a turn or
        a line starts right after them."""
        if not self._marks(job) or self.follow is None:
            return None
        try:
            return self.follow(job, text)
        except Exception:  # an optimisation: without it the next turn re-feeds the answer itself
            logging.getLogger("kvstate.serve").warning("rendering the next turn's history failed", exc_info=True)
            return None

    def _defer_settle(self, job: Job, state: Any, text: str) -> None:
        """Queue the settle of ``job``'s reply ``text`` (its state ``state``) for when the model is idle, or for
        the conversation's next request, whichever comes first."""
        if self.canonical_chunk and self.pool.max_bytes:  # a pool of 0 bytes: no reuse, nothing to settle for
            self._unsettled.append(Unsettled(job.namespace, state, self._through(job, text), self._marks(job)))

    def _settle_idle(self) -> None:
        """Settle the waiting replies, newest first, while no request waits. Each first waits ``SETTLE_GRACE``
        for a request: one sent as soon as a reply ends runs first instead of waiting for a settle, which is
        one forward. If it continues a waiting reply (the chat's next turn), ``_settle_for`` settles that one
        before it; another chat's request does not wait for a settle it does not need."""
        while True:
            self._forget_unpooled()
            if not self._unsettled or not self._idle_for(SETTLE_GRACE):
                return
            self._settle(self._unsettled.pop())

    def _settle_for(self, job: Job) -> None:
        """Before ``job`` runs: settle the waiting reply that its prompt continues (same namespace; the ids the
        settle feeds through, or the reply's own tokens, begin the prompt), and pool the settled state. The
        conversation's next request then resumes from it whatever the client's timing: an agent that asks again
        as soon as a reply arrives reuses as much as one that pauses, and the same forwards run, in this
        request's time instead of the idle model's."""
        for entry in reversed(self._unsettled):  # the newest first: it is the longest of its conversation
            if entry.namespace == job.namespace and entry.continued_by(job.prompt.ids):
                self._unsettled.remove(entry)  # its conversation went on: the idle model need not settle it
                if entry.settles_for(job.prompt.ids, self.canonical_chunk):
                    self._settle(entry)
                return

    def _forget_unpooled(self) -> None:
        """Drop the waiting settles of states the pool no longer holds: their chat went on (a newer state covers
        them) or the pool evicted them, and holding them here would keep their K/V past the pool's budget."""
        held = [entry for entry in self._unsettled if self.pool.holds(entry.namespace, entry.state)]
        self._unsettled.clear()
        self._unsettled.extend(held)

    def _idle_for(self, seconds: float) -> bool:
        """Whether no request arrives (and the runner is not closing) within ``seconds``."""
        self._arrived.clear()  # before reading the flags: a submit or close after this sets it again
        return not (self._busy() or self._arrived.wait(seconds) or self._busy())

    def _busy(self) -> bool:
        return bool(self._pending) or self._closing or self._draining

    def _settle(self, entry: Unsettled) -> None:
        """After a reply: recompute its decoded tokens in canonical chunks, so the next turn's pool hit
        re-feeds only the tail since the last cut (the canonical schedule). Runs on the model thread between jobs; a
        failure here costs the next turn that re-feed, never an answer."""
        try:
            session = Session(self.model, state=entry.state, **self._session_settings(entry.marks))
            if session.settle(entry.through):
                self.pool.put(entry.namespace, session.state)
        except Exception:  # an optimisation: the unsettled state is in the pool already; say why it failed
            logging.getLogger("kvstate.serve").warning("settling a reply failed", exc_info=True)

    def _session_settings(self, marks: tuple[int, ...]) -> dict[str, Any]:
        """What every ``Session`` of this runner is built with, for a history fed with ``marks``: its states are
        one another's (and the scheduler's, for ``BatchRunner``), so each resumes from the others' canonical
        slots."""
        return dict(chunk_size=self.chunk_size, canonical_chunk=self.canonical_chunk, canonical_marks=marks,
                    fingerprint=self.fingerprint, **self.kernels)

    def _done(self, job: Job) -> None:
        with self._lock:
            self._pending -= 1
            self._jobs.discard(job)

    def close(self) -> None:
        """Cancel what is queued or running (each stops at its next token, committing nothing) and wait."""
        with self._lock:
            for job in self._jobs:
                job.cancelled.set()
            self._closing = True
        self._arrived.set()  # a settle waiting for its grace returns, and no other starts
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _run(self, job: Job) -> Result:
        if job.cancelled.is_set():
            raise Cancelled
        if self._halted.is_set():
            raise shutting_down()
        self._settle_for(job)
        started = time.perf_counter()
        ids = torch.tensor([job.prompt.ids], dtype=torch.long)
        store = self.store_for(job.namespace)
        marks = self._marks(job)
        sources = [self.pool.source(job.namespace, marks), *(() if store is None else (store,))]
        session = Session(self.model, sources=sources, **self._session_settings(marks))
        streamer = _Streamer(self.tokenizer, job)
        options = dict(job.request.options)
        if job.request.seed is not None:
            torch.manual_seed(job.request.seed)
        halt = _Halt(self._halted)
        options["stopping_criteria"] = [*options.get("stopping_criteria", ()), halt]
        try:
            if "stop_strings" in options:  # refused as generate(stop_strings=...) would: no token spells one
                options["stopping_criteria"].append(self._stop_criterion(tuple(options.pop("stop_strings"))))
            outcome = session.run(ids, streamer=streamer, **options, **job.inputs)
        except (ValueError, TypeError) as exc:
            if streamer.tokens:  # a failure mid-answer is the server's, not the request's
                raise
            # transformers validates some options only when generate builds its processors (5.14 refuses a
            # logit_bias on token 0, say): still the request's mistake, and nothing was committed
            raise BadRequest(f"invalid generation options: {exc}") from exc
        tokens = outcome.tokens[0].tolist()
        text, stopped = streamer.final(tokens)
        self._defer_settle(job, outcome.state, text)
        with contextlib.suppress(RuntimeError):  # the executor is shutting down: nothing to settle for
            self._executor.submit(self._settle_idle)
        finish = "stop" if stopped else "length" if halt.fired else outcome.finish_reason[0]
        k = job.request.logprobs
        logprobs = streamer.logprobs if k is None or streamer.complete else \
            compute(outcome.output.logits, tokens, k, self.tokenizer, text)
        result = Result(text, finish, len(job.prompt.ids), len(tokens), outcome.reused,
                        time.perf_counter() - started, logprobs)
        self.metrics.record(result)
        return result


class _Halt:
    """A stopping criterion that ends the answer once the server's shutdown deadline passed (``Runner.halt``);
    ``fired`` says whether it did."""

    def __init__(self, halted: threading.Event) -> None:
        self.halted, self.fired = halted, False

    def __deepcopy__(self, memo: dict[int, Any]) -> _Halt:  # a copy must watch the same deadline and report here
        return self

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.fired = self.fired or self.halted.is_set()
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)


class _Streamer:
    """A transformers streamer that turns new tokens into final text: it holds back an incomplete
    character and any tail that may still become a stop string, and cuts the answer at the first stop.
    With ``logprobs`` it also takes each token's step (``put_logits``: the raw logits, from the engine;
    ``put_step``: computed, from the batched scheduler) and reports tokens (``logprobs.Reporter``)."""

    def __init__(self, tokenizer: Any, job: Job) -> None:
        self.tokenizer, self.job = tokenizer, job
        self.stop = job.request.stop
        self.tokens: list[int] = []
        self.sent = 0
        self._prompt_seen = False
        self._decoded: tuple[int, str, bool] = (0, "", False)  # (tokens, text, stopped) of the last decode
        self.k = job.request.logprobs
        self.reporter = None if self.k is None else Reporter(tokenizer)
        self.complete = self.k is not None  # every token came with its step
        self._step: Step | torch.Tensor | None = None  # the next token's step, or the logits [V] it comes from

    def put_logits(self, logits: torch.Tensor | None) -> None:
        """The raw logits ``[1, V]`` the next token is chosen from."""
        self._step = None if logits is None else logits[0]

    def put_step(self, step: Step) -> None:
        """The next token's logprob and top alternatives, computed by the caller."""
        self._step = step

    def put(self, value: torch.Tensor) -> None:
        if self.job.cancelled.is_set():
            raise Cancelled
        if not self._prompt_seen:  # generate echoes the history first
            self._prompt_seen = True
            return
        new = value.reshape(-1).tolist()
        self._report(new)
        self.tokens.extend(new)
        if self.job.on_text is None and self.job.on_token is None:
            return
        text, stopped = self._text(self.tokens)
        ready = len(text) if stopped else len(text) - self._held(text)
        if self.job.on_token is not None and self.reporter is not None and self.complete:
            for piece, item in self.reporter.ready(text, ready):
                self.job.on_token(piece, item)
        elif self.job.on_text is not None and ready > self.sent:
            self.job.on_text(text[self.sent:ready])
            self.sent = ready

    def _report(self, new: list[int]) -> None:
        """Give the reporter the new token with its step (a put without one leaves the report incomplete)."""
        step, self._step = self._step, None
        if self.reporter is None or not self.complete:
            return
        if step is None or len(new) != 1:
            self.complete = False
            return
        token = new[0]  # computed now: holding each step's logits [V] would cost V floats per token
        self.reporter.add(token, step if isinstance(step, tuple) else step_of(step, token, self.k))  # type: ignore[arg-type]

    def end(self) -> None:
        """Nothing here: ``final`` sends the rest once the state is committed."""

    def final(self, tokens: list[int]) -> tuple[str, bool]:
        """The whole answer (cut at a stop string, and whether one was found); sends what is left."""
        text, stopped = self._text(tokens)
        if self.reporter is not None and self.complete and tokens == self.tokens:
            rest = self.reporter.rest(text)
            if self.job.on_token is not None:
                for piece, item in rest:
                    self.job.on_token(piece, item)
        else:
            self.complete = False
        if self.job.on_text is not None and len(text) > self.sent:
            self.job.on_text(text[self.sent:])
        return text, stopped

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The reported tokens, once ``final`` ran with every step (None without logprobs)."""
        return None if self.reporter is None else tuple(self.reporter.items)

    @property
    def stopped(self) -> bool:
        """Whether the answer so far holds a stop string (decoded once per token, whoever asks)."""
        return bool(self.stop) and self._text(self.tokens)[1]

    def _text(self, tokens: list[int]) -> tuple[str, bool]:
        if self._decoded[0] == len(tokens) and tokens is self.tokens:
            return self._decoded[1:]  # type: ignore[return-value]
        reporter = self.reporter
        shared = reporter is not None and self.complete and tokens == reporter.tokens
        text = reporter.decoded if shared else self.tokenizer.decode(tokens, skip_special_tokens=True)  # type: ignore[union-attr]
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        text, stopped = (text[:min(cuts)], True) if cuts else (text, False)
        if tokens is self.tokens:
            self._decoded = (len(tokens), text, stopped)
        return text, stopped

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` not yet final: a partial UTF-8 character (U+FFFD for each byte token
        so far), or a stop string's start."""
        held = len(text) - len(text.rstrip("\ufffd"))  # a character split over 3 or 4 byte tokens shows several
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    held = max(held, k)
                    break
        return held
