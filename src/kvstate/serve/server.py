"""``Server``: the model, its tokenizer, the pool, the stores and the runner of one ``kvstate serve``."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import InputError
from ..schedule import default_chunk, default_gap
from ..settings import Batching
from ..settings import Settings as EngineSettings
from ..store import PrefixStore
from ..text import PromptMarks
from .chat import Prompt, Renderer
from .errors import BadRequest
from .media import ImageEncoder
from .metrics import Metrics
from .params import Limits
from .pool import StatePool
from .runner import Runner


@dataclass(frozen=True)
class Settings:
    """What ``kvstate serve`` takes besides the model: see ``kvstate serve --help``."""

    store: str | None = None
    api_keys: tuple[str, ...] = ()
    limits: Limits = field(default_factory=Limits)
    max_request_bytes: int = 16 << 20
    max_queue: int = 16
    pool_bytes: int = 2 << 30
    store_chunk_tokens: int = 64
    chunk_size: int = 512
    canonical_chunk: int | None = None  # the schedule's C (kvstate.schedule.default_chunk); 0 turns it off
    turn_marks: bool = True  # cut the schedule where the chat template starts a user turn (kvstate.schedule)
    # > 1: requests decode together (kvstate.serve.runner); None: the device's (``default_batch``)
    max_batch: int | None = None
    prefill_per_step: int = 512  # batched: prompt tokens a step feeds, about (kvstate.settings.Batching)
    batch_invariant: bool = True  # False: plain kernels in the batched forward (measures the invariance tax)
    batch_prepack: bool = True  # the tiles on prepacked weights (kvstate.settings.Settings.prepack)
    batch_prefill_rows: int = 32  # the prefill's tile; 0: each prompt in plain forwards (Settings.prefill_rows)
    batch_gather_ms: int = 20  # an idle batched server admits a burst together (Runner._gather); 0: off
    reuse: bool = True  # False: no pool and no store, every request runs cold (verify --against's cold twin)
    shutdown_timeout: float = 20.0  # a graceful stop's seconds for running answers, then they end (``Server.stop``)

    def __post_init__(self) -> None:
        bad = [key for key in self.api_keys if not isinstance(key, str) or not key.strip() or key != key.strip()]
        if bad:  # an empty key matches a request that sends none: a server that looks protected would be open
            raise InputError("API keys must be non-empty strings without surrounding spaces",
                             found=f"{len(bad)} such key(s) among {len(self.api_keys)}",
                             fix="pass the keys themselves, or no api_keys to serve without keys")


class Server:
    """Everything a request needs; the app (``kvstate.serve.app``) only speaks HTTP."""

    def __init__(self, model: Any, tokenizer: Any, model_id: str, settings: Settings | None = None, *,
                 image_processor: Any = None) -> None:
        from .._version import __version__
        from ..adopt import context_length
        from ..selfcheck import bind, vocab_size

        self.settings = settings = settings or Settings()
        self.model, self.tokenizer, self.model_id, self.version = model, tokenizer, model_id, __version__
        self.api_keys, self.limits = settings.api_keys, settings.limits
        self.max_request_bytes = settings.max_request_bytes
        tokens = bind(model).inputs.image_tokens()
        self.images = None if tokens is None or image_processor is None else \
            ImageEncoder(image_processor, tokenizer, tokens)
        self.vocab = vocab_size(model)  # the one rule Session validates ids with
        self.context = context_length(model)
        self.renderer = Renderer(tokenizer, image_placeholder=self.images.placeholder if self.images else None,
                                 vocab=self.vocab)
        limits = settings.limits
        self.metrics = Metrics(model_id, self._gauges, max_tokens=limits.max_prompt_tokens + limits.max_new_tokens)
        self.pool = StatePool(settings.pool_bytes if settings.reuse else 0)  # a zero budget keeps nothing
        self._stores: dict[str, PrefixStore] = {}
        if settings.store is not None and settings.reuse:
            self._stores["default"] = PrefixStore(settings.store, chunk_tokens=settings.store_chunk_tokens)
        marked = settings.canonical_chunk != 0 and settings.turn_marks
        self.marks = self.renderer.marks if marked else ()  # a chat's cuts: where its template starts a user turn
        chunk = settings.canonical_chunk
        device = next(model.parameters()).device.type
        self.canonical_chunk = default_chunk(self.marks, device) if chunk is None else chunk
        # a raw prompt's cuts: after its last line's label, and at lines a gap apart (kvstate.schedule)
        self.prompts = PromptMarks(tokenizer, default_gap(self.canonical_chunk)) if marked else None
        self.max_batch = default_batch(device) if settings.max_batch is None else settings.max_batch
        self.runner = Runner(self, engine_settings(settings, self.canonical_chunk, self.marks, self.max_batch),
                             settings.max_queue, settings.batch_gather_ms / 1000)
        self.started = int(time.time())
        self.stopping = threading.Event()  # a graceful stop began (``stop``): new requests get a 503

    def following(self, prompt: Prompt, text: str) -> list[int] | None:
        """The ids the next turn of ``prompt``'s reply ``text`` begins with (``Renderer.following``)."""
        return self.renderer.following(prompt, text)

    def marks_for(self, chat: bool, ids: list[int]) -> tuple[int, ...]:
        """The canonical schedule's marks for a chat's prompt (turn marks) or a completions prompt of ``ids``
        (prompt marks: its own last line's label, ``kvstate.text.PromptMarks``)."""
        if chat:
            return self.marks
        return self.prompts(ids) if self.prompts is not None else ()

    def store_for(self, namespace: str) -> PrefixStore | None:
        """The namespace's view of the store (same backend, keys salted by the namespace)."""
        if self.settings.store is None or not self.settings.reuse:
            return None
        if namespace not in self._stores:
            self._stores[namespace] = PrefixStore(self.settings.store, chunk_tokens=self.settings.store_chunk_tokens,
                                                  namespace=namespace)
        return self._stores[namespace]

    def render(self, content: Any, chat: bool) -> tuple[Prompt, dict[str, Any]]:
        """A request's messages (``chat``) or prompt as a ``Prompt`` and the model inputs for its media."""
        prompt = self.renderer.chat(content) if chat else self.renderer.completion(content)
        if self.images is None:
            return prompt, {}
        if not prompt.images:
            self.images.check_text_only(prompt.ids)
            return prompt, {}
        ids, inputs = self.images.encode(prompt.ids, prompt.images)
        return replace(prompt, ids=ids), inputs

    def check_prompt(self, prompt: Prompt, new_tokens: int = 0) -> None:
        """A prompt within ``--max-prompt-tokens`` and, with ``new_tokens`` more, the model's positions (its
        config's ``max_position_embeddings`` or ``n_positions``: past them a learned position table has no row)."""
        limit = self.limits.max_prompt_tokens
        if len(prompt.ids) > limit:
            raise BadRequest(f"This model's maximum context length for a request is {limit} tokens; the request has "
                             f"{len(prompt.ids)}.", param="messages", code="context_length_exceeded",
                             fix="shorten the conversation, or start the server with a larger --max-prompt-tokens")
        if self.context is not None and len(prompt.ids) + new_tokens > self.context:
            raise BadRequest(f"This model's maximum context length is {self.context} tokens; the request asks for "
                             f"{len(prompt.ids) + new_tokens} ({len(prompt.ids)} in the prompt, {new_tokens} new).",
                             param="max_tokens", code="context_length_exceeded",
                             fix="shorten the prompt or lower max_tokens")
        if any(not 0 <= t < self.vocab for t in prompt.ids):
            raise BadRequest(f"token ids must be in [0, {self.vocab})", param="prompt", code="invalid_value")

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.started, "owned_by": "kvstate"}

    def stop(self) -> None:
        """Begin a graceful stop (``kvstate serve`` on SIGTERM or Ctrl-C): new requests get a 503 and ``/health``
        says ``draining``; queued and running requests go on for ``shutdown_timeout`` seconds, then each running
        answer ends at its next token (``finish_reason`` ``length``, its state kept in the pool and the store).
        Call it from a thread, not from a signal handler (it takes locks); more than once is fine."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.runner.stop_accepting()
        timer = threading.Timer(self.settings.shutdown_timeout, self.runner.halt)
        timer.daemon = True  # a process that finished draining early does not wait for it
        timer.start()

    def health(self) -> dict[str, Any]:
        store = self.store_for("default")
        weight = next(self.model.parameters())  # what the answers are computed in (the canonical schedule)
        return {"status": "draining" if self.stopping.is_set() else "ok", "model": self.model_id,
                "dtype": str(weight.dtype).removeprefix("torch."),
                "device": str(weight.device), "queue": self.runner.pending, "max_queue": self.settings.max_queue,
                "store": None if store is None else store.health()}

    def _gauges(self) -> dict[str, tuple[str, float]]:
        """What ``/metrics`` reads at each scrape (``Metrics``): the queue, the pool, the store."""
        gauges = {
            "queue_depth": ("Requests waiting or running (at --max-queue, the next gets a 429).", self.runner.pending),
            "pool_states": ("Conversation states in the in-memory pool.", len(self.pool)),
            "pool_bytes": ("Bytes of K/V and other state in the in-memory pool.", self.pool.nbytes),
            "store_failures": ("Prefix store reads or writes that failed in this process.",
                               sum(s.failures for s in self._stores.values())),
        }
        store = self.store_for("default")
        try:
            counters = {} if store is None else store.backend.counters()
        except Exception:  # an unreachable store: /health says why, and its failures are counted above
            return gauges
        if store is not None:
            gauges["store_hits"] = ("Prefix store lookups that found a prefix, by every server sharing the store.",
                                    counters.get("hits", 0))
            gauges["store_misses"] = ("Prefix store lookups that found none, by every server sharing the store.",
                                      counters.get("misses", 0))
        return gauges

    def close(self) -> None:
        """Stop the runner; after a graceful stop (``stop``), first settle the replies still waiting for it into the
        store (``Runner.settle_pending``)."""
        if self.stopping.is_set():
            self.runner.settle_pending()
        self.runner.close()


# Requests a server decodes together when ``--max-batch`` is not given: on a GPU a decode step reads every
# weight once whatever its rows, so batching is nearly free; on a CPU one request at a time stays the default
# (the batched decoder's tiles cost a lone request, measured in docs/batching.md).
DEVICE_BATCH = {"cuda": 16}


def engine_settings(settings: Settings, canonical_chunk: int, marks: tuple[int, ...], max_batch: int) -> EngineSettings:
    """The one ``kvstate.settings.Settings`` a server runs with: its feed and schedule, and its batching. One request
    at a time (``max_batch`` 1) runs ``Session``'s own kernels (one-row decode tiles, plain prefill forwards) and
    feeds each history whole; batched, the tiles and the per-step prefill budget of ``settings``."""
    if max_batch == 1:
        return EngineSettings(settings.chunk_size, canonical_chunk, marks, batching=Batching(1, rows=1))
    return EngineSettings(settings.chunk_size, canonical_chunk, marks, prefill_rows=settings.batch_prefill_rows,
                          prepack=settings.batch_prepack, invariant=settings.batch_invariant,
                          batching=Batching(max_batch, prefill_tokens=settings.prefill_per_step))


def default_batch(device: str) -> int:
    """``max_batch`` on a ``device`` type (``DEVICE_BATCH``, else 1)."""
    return DEVICE_BATCH.get(device, 1)


def model_id_for(spec: str) -> str:
    """The name ``/v1/models`` lists: ``gemma-3-270m`` for the default model, ``smollm2-135m-instruct``
    for SmolLM2, the spec for tiny models, the folder's own name otherwise (never its path)."""
    if spec == "default":
        return "gemma-3-270m"
    if spec == "smollm2":
        return "smollm2-135m-instruct"
    if spec.startswith("tiny:"):
        return spec
    return spec.rstrip("/").rsplit("/", 1)[-1]
