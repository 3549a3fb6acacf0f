"""``kvstate serve --max-batch N``: requests decode together, each answer bit for bit what it gets alone.

``BatchRunner`` is a ``Runner`` whose model thread drives one ``kvstate.batch.Scheduler``
(continuous batching, continuous batching) instead of one ``Session`` per request. The HTTP side is the
same: one bounded queue (``max_queue`` waiting or running, then a 429), streamed text, and
cancel-on-disconnect (a cancelled request leaves the batch at the next step and commits
nothing). The loop on the model thread takes new jobs, cancels the ones whose clients left,
runs one scheduler step (admissions, then one decode step for every running request), and
hands each token to its request's streamer.

What runs batched: every option ``params`` maps: greedy and sampling (``temperature``, ``top_p``,
``top_k``, ``min_p``, ``seed``) with ``stop`` strings, ``logprobs`` (the scheduler's own, the same
``log_softmax`` of the raw float32 logits that ``logprobs.compute`` takes of generate's),
``logit_bias``, ``repetition_penalty`` and the presence / frequency penalties (the logits
processors ``generate`` would build, run on the request's own row and ids). A request with an
option the per-request sampler does not have (none that ``params`` produces today) runs through
``Session.generate`` between two steps, as ``Runner`` runs it: alone, so its answer is its answer
alone too. Each finished answer's state
joins the namespace's pool (its prompt's state went to the pool and the store at admission), and
is settled into canonical chunks when the model is idle.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from typing import Any

import torch

from ..batch import BatchRequest, Done, Failed, Sampling, Scheduler, Token
from ..batch.sampling import Choice
from ..batch.scheduler import Completion
from ..errors import KVStateError
from .errors import BadRequest
from .logprobs import build
from .runner import Cancelled, Job, Result, Runner, _Streamer, shutting_down

_BATCHED_OPTIONS = {"max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "stop_strings",
                    "output_logits", "return_dict_in_generate",  # these two: logprobs, which the sampler gives
                    "sequence_bias", "repetition_penalty", "logits_processor"}  # processors, in generate's order


GATHER_CAP = 10  # a burst is gathered for at most this many quiet gaps (``BatchRunner._gather``)


class _Active:
    """A job inside the scheduler: its future, its streamer and when it started."""

    def __init__(self, job: Job, future: concurrent.futures.Future[Result], streamer: _Streamer) -> None:
        self.job, self.future, self.streamer = job, future, streamer
        self.started = time.perf_counter()
        self.halted = False  # ended by the shutdown deadline (``Runner.halt``)


class BatchRunner(Runner):
    """``Runner``'s queue, cancellation and pool, with batched decoding (see the module docstring)."""

    def __init__(self, *args: Any, max_batch: int = 8, rows: int = 16, invariant: bool = True, prepack: bool = True,
                 prefill_rows: int = 32, prefill_tokens: int = 512, gather: float = 0.02, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gather = gather  # seconds of quiet that end a burst of arrivals at an idle model (``_gather``)
        self.kernels = dict(prefill_rows=prefill_rows, prepack=prepack, invariant=invariant)
        # a step feeds about prefill_tokens prompt tokens (a burst of prompts, or a long history in pieces), so
        # running answers keep streaming; prefixes are shared through each key's pool namespace, never across keys
        self.scheduler = Scheduler(self.model, max_batch=max_batch, rows=rows, invariant=invariant,
                                   prepack=prepack, prefill_rows=prefill_rows, prefill_tokens=prefill_tokens,
                                   share_prefixes=False, canonical_chunk=self.canonical_chunk,
                                   canonical_marks=self.canonical_marks,
                                   chunk_size=self.chunk_size, fingerprint=self.fingerprint)
        self._inbox: deque[tuple[Job, concurrent.futures.Future[Result]]] = deque()
        self._active: dict[int, _Active] = {}
        self._looping = False
        self.peak = 0  # the most requests that ever decoded together

    def submit(self, job: Job) -> concurrent.futures.Future[Result]:
        """Queue ``job``; a full queue is a 429 before anything is queued."""
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

    def close(self) -> None:
        """``Runner.close``; then any job whose loop never started (the executor dropped it) is cancelled too."""
        super().close()
        with self._lock:
            left, self._inbox = list(self._inbox), deque()
        for _, future in left:
            future.set_exception(Cancelled())

    # ----- the model thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        """Steps while anything waits or runs; then settles the answers and returns the thread."""
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
                logging.getLogger("kvstate.serve").error("a batched step failed", exc_info=True)
                self._fail_all(exc)
        self._settle_idle()

    def _gather(self) -> None:
        """At an idle model, let a burst of requests arrive before the first step: clients that send together
        (one per user of an app, a benchmark's streams) otherwise get the first request prefilled and decoded
        alone while the rest queue behind that step (measured: 16 streams of the default model in bfloat16,
        a 230 ms step before the other 15 were admitted). Waits while requests keep arriving less than
        ``gather`` apart (at most ``GATHER_CAP`` gaps), never past a full batch; a lone request pays one
        ``gather``. Busy, nothing waits: arrivals join at the next step boundary."""
        if self.gather <= 0 or self.scheduler.busy:
            return
        for _ in range(GATHER_CAP):
            with self._lock:  # nothing arrived (the loop is about to end): nothing to gather for
                if not self._inbox or len(self._inbox) >= self.scheduler.settings.batching.max_batch or self._closing:
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
        self._settle_for(job)  # its conversation's last reply, settled first: the scheduler resumes from that
        request = self._batch_request(job)
        if request is None:
            try:
                future.set_result(self._run(job))
            except Exception as exc:
                future.set_exception(exc)
            return
        handle = self.scheduler.submit(request)
        streamer = _Streamer(self.tokenizer, job)
        streamer.put(torch.tensor(job.prompt.ids))  # what generate's streamer sees first: the history
        self._active[handle] = _Active(job, future, streamer)

    def _batch_request(self, job: Job) -> BatchRequest | None:
        options = dict(job.request.options)
        if set(options) - _BATCHED_OPTIONS:
            return None
        sampling = Sampling(options["temperature"], options.get("top_k", 0), options.get("top_p", 1.0),
                            seed=job.request.seed, min_p=options.get("min_p", 0.0)) \
            if options.get("do_sample") else Sampling()
        store = self.store_for(job.namespace)
        marks = self._marks(job)
        sources = (self.pool.source(job.namespace, marks), *(() if store is None else (store,)))
        return BatchRequest(torch.tensor(job.prompt.ids), max_new_tokens=options["max_new_tokens"],
                            sampling=sampling, inputs=job.inputs, sources=sources, marks=marks,
                            top_logprobs=job.request.logprobs or 0, processors=_processors(options))

    def _dispatch(self, event: Token | Done | Failed) -> None:
        active = self._active.get(event.handle)
        if active is None:
            return
        if isinstance(event, Token):
            self._token(event.handle, active, event.choice)
        elif isinstance(event, Done):
            del self._active[event.handle]
            self._finish(active, event.completion)
        else:
            del self._active[event.handle]
            error = event.error  # the request's own mistake is a 400, as Runner reports it; anything else a 500
            refused = isinstance(error, (ValueError, TypeError)) and not isinstance(error, KVStateError)
            active.future.set_exception(BadRequest(f"invalid request: {error}") if refused else error)

    def _token(self, handle: int, active: _Active, choice: Choice) -> None:
        try:
            active.streamer.put_step((choice.logprob, choice.top))
            active.streamer.put(torch.tensor([choice.token]))
        except Cancelled:
            self.scheduler.cancel(handle)
            return
        if active.streamer.stopped:
            self.scheduler.stop(handle)  # the answer is complete; it keeps its state, as generate's stop does

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
            self.pool.put(job.namespace, completion.state)
            self._defer_settle(job, completion.state, text)
        k = job.request.logprobs
        logprobs = active.streamer.logprobs if k is None or active.streamer.complete else build(
            tokens, lambda i: (completion.logprobs[i], completion.top_logprobs[i]), self.tokenizer, text)
        result = Result(text, finish, len(job.prompt.ids), len(tokens), completion.reused,
                        time.perf_counter() - active.started, logprobs)
        self.metrics.record(result)
        active.future.set_result(result)

    def _fail_all(self, exc: Exception) -> None:
        for handle in self.scheduler.abort():
            active = self._active.pop(handle, None)
            if active is not None:
                active.future.set_exception(exc)


def _processors(options: dict[str, Any]) -> tuple[Any, ...]:
    """The logits processors ``generate`` builds for ``options`` that are not sampling's own, in its order:
    ``sequence_bias`` (``logit_bias``), ``repetition_penalty``, then the request's own (OpenAI's penalties)."""
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    out: list[Any] = []
    if options.get("sequence_bias"):
        out.append(SequenceBiasLogitsProcessor(sequence_bias=options["sequence_bias"]))
    if options.get("repetition_penalty", 1.0) != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(penalty=options["repetition_penalty"]))
    return (*out, *options.get("logits_processor", ()))
