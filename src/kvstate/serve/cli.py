"""``kvstate serve``: its options and its start-up (checked before the model loads)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

API_KEY_ENV = "KVSTATE_API_KEY"


def add_parser(sub: Any, positive: Any, non_negative: Any, model_options: Any) -> None:
    s = sub.add_parser(
        "serve", help="an OpenAI-compatible server whose conversations resume exactly across turns and restarts",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics. Every request "
        "continues the longest matching conversation state (an in-memory pool, then --store), so a turn costs "
        "only its new tokens, and answers equal a fresh run on the whole history. Model work runs one request at "
        "a time (or --max-batch at once); HTTP, tokenization and streaming run concurrently. "
        "Needs: pip install 'kvstate[serve]'.")
    s.add_argument("--model", default="default", help="'default' (embedded Gemma-3-270M), 'smollm2' (embedded "
                   "SmolLM2-135M-Instruct), 'tiny:<model_type>' (random tiny model with a character tokenizer), or "
                   "a local folder with a tokenizer")
    model_options(s)
    s.add_argument("--model-name", help="the model id clients send and /v1/models lists (default: from --model)")
    s.add_argument("--store", help="prefix store shared by restarts and workers: a folder or redis://host:port/db")
    s.add_argument("--store-chunk-tokens", type=positive, default=64,
                   help="store granularity in tokens (a multiple of --canonical-chunk, so every entry is reusable)")
    s.add_argument("--canonical-chunk", type=non_negative, default=None, metavar="C",
                   help="prefill in chunks of C aligned to the turn marks (or to multiples of C), so a pool or store "
                   "hit answers bit for bit as a cold run (default 256 with turn marks, 64 without; 0: off, reuse "
                   "the longest prefix, exact to float32 rounding only)")
    s.add_argument("--no-turn-marks", action="store_true",
                   help="cut canonical chunks at multiples of C only. By default they also start where the chat "
                   "template starts a user turn (chats: once an answer is settled the next turn feeds only its own "
                   "tokens) and right after a completions prompt's last-line label such as 'A:' (a continued "
                   "prompt feeds the answer and its own tokens in one forward) (docs/exactness.md)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", action="append", default=[], help=f"accepted key (repeatable; or ${API_KEY_ENV}, "
                   "comma-separated). Each key has its own pool and store namespace")
    s.add_argument("--max-queue", type=positive, default=16,
                   help="requests queued or running before a 429 (default: 16)")
    s.add_argument("--max-batch", type=positive, default=None, metavar="N",
                   help="requests that decode together in one forward, each answer bit for bit what it gets alone "
                   "(default: 16 on a GPU, 1 on a CPU: one request at a time)")
    s.add_argument("--prefill-per-step", type=positive, default=512, metavar="TOKENS",
                   help="with --max-batch: prompt tokens a step feeds between decode steps, about (one canonical "
                   "chunk at least). A burst of prompts and a long history are spread over steps, so running "
                   "answers keep streaming; smaller: shorter stalls, slower first tokens (default 512)")
    s.add_argument("--batch-invariance", choices=["on", "off"], default="on",
                   help="on (default): batched forwards run in fixed 16-row tiles, so an answer never depends on "
                   "the other requests; off: plain kernels, for measuring what that costs (docs/batching.md)")
    s.add_argument("--batch-prepack", choices=["on", "off"], default="on",
                   help="on (default): the tiles' products run on weights prepacked for them (oneDNN; CPU float32 "
                   "and bfloat16): a decode step about 20%% faster, for a copy of the linear weights (1.1 GB for the "
                   "default model in float32); off: torch's F.linear kernels (answers as exact, other bits)")
    s.add_argument("--batch-prefill-rows", type=non_negative, default=32, metavar="ROWS",
                   help="with --max-batch: prompt chunks run in tiles of ROWS rows, and the prompts admitted in one "
                   "step share one forward, each with the bits it gets alone (default 32); 0: each prompt in plain "
                   "forwards of its own. A state records the tile: a conversation moved to a server with another "
                   "tile is fed again, never resumed from other kernels' slots")
    s.add_argument("--batch-gather-ms", type=non_negative, default=20, metavar="MS",
                   help="with --max-batch: an idle server waits while requests keep arriving less than MS apart "
                   "(at most 10 such gaps, never past a full batch), so a burst is prefilled in one step instead "
                   "of the first request alone; a lone request waits MS once (default 20; 0: off)")
    s.add_argument("--max-request-bytes", type=positive, default=16 << 20,
                   help="larger bodies get a 413 (default: 16 MiB)")
    s.add_argument("--max-prompt-tokens", type=positive, default=8192,
                   help="longer prompts get a 400 (default: 8192)")
    s.add_argument("--max-new-tokens", type=positive, default=2048,
                   help="bound on a request's max_tokens (default: 2048)")
    s.add_argument("--max-stop-strings", type=non_negative, default=4, metavar="N",
                   help="stop strings a request may send (default: 4, as OpenAI)")
    s.add_argument("--max-stop-length", type=positive, default=32, metavar="CHARS",
                   help="characters of each stop string (default: 32). transformers matches stop strings with a "
                   "table of vocabulary x length: each character costs 4 bytes per vocabulary entry (1 MiB for "
                   "Gemma's 262k tokens), built once per stop set and held while it is in use")
    s.add_argument("--default-max-tokens", type=positive, default=256,
                   help="max_tokens of a chat request that names none (completions: 16, as OpenAI)")
    s.add_argument("--pool-bytes", type=positive, default=2 << 30,
                   help="memory for recent conversation states (default: 2 GiB)")
    s.add_argument("--no-reuse", action="store_true", help="no pool and no store: every request runs cold and "
                   "reports cached_tokens 0 (the cold twin for `kvstate verify --against URL --cold URL2`)")
    s.add_argument("--shutdown-timeout", type=non_negative, default=20, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C: stop accepting (new requests get a 503), let running requests "
                   "finish for SECONDS, then end each running answer at its next token (finish_reason 'length', "
                   "its state kept in the store), and exit 0 (default 20)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def command(args: argparse.Namespace, user_error: type[Exception]) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise user_error(f"kvstate serve needs FastAPI and uvicorn ({exc.name} is missing)",
                         fix="pip install 'kvstate[serve]'") from exc
    from . import Server, Settings, run
    from .params import Limits
    from .server import model_id_for

    keys = api_keys(args.api_key, os.environ.get(API_KEY_ENV), user_error)
    if args.no_reuse and args.store is not None:
        raise user_error("--no-reuse runs every request cold, so it has no store", fix="drop --store (or --no-reuse)")
    if args.store is not None:
        from ..store import PrefixStore

        PrefixStore(args.store).health()  # an unusable folder or a malformed URL fails now, not per request
    limits = Limits(args.max_prompt_tokens, args.max_new_tokens, min(args.default_max_tokens, args.max_new_tokens),
                    max_stop_strings=args.max_stop_strings, max_stop_length=args.max_stop_length)
    settings = Settings(store=args.store, api_keys=keys, limits=limits, max_request_bytes=args.max_request_bytes,
                        max_queue=args.max_queue, pool_bytes=args.pool_bytes,
                        store_chunk_tokens=args.store_chunk_tokens, canonical_chunk=args.canonical_chunk,
                        turn_marks=not args.no_turn_marks, max_batch=args.max_batch,
                        prefill_per_step=args.prefill_per_step,
                        batch_invariant=args.batch_invariance == "on", batch_prepack=args.batch_prepack == "on",
                        batch_prefill_rows=args.batch_prefill_rows, batch_gather_ms=args.batch_gather_ms,
                        reuse=not args.no_reuse, shutdown_timeout=args.shutdown_timeout)
    model, tokenizer = load(args.model, dtype=args.dtype, device=args.device)
    server = Server(model, tokenizer, args.model_name or model_id_for(args.model), settings,
                    image_processor=image_processor(args.model))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not keys:
        print(f"kvstate serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    run(server, args.host, args.port, args.log_level)
    return 0


def api_keys(flags: list[str], env: str | None, user_error: type[Exception]) -> tuple[str, ...]:
    """The keys of ``--api-key`` and ``$KVSTATE_API_KEY`` (comma-separated). An empty or blank key is refused, as is
    a variable that is set and holds none: ``--api-key "$KEY"`` with ``KEY`` unset would otherwise serve an open
    server that looks protected (a request without a key matched the empty one)."""
    for key in flags:
        if not key.strip():
            raise user_error("--api-key is empty (a shell variable that is not set?): a request without any key "
                             "would match it", fix="pass the key itself, or drop --api-key to serve without keys")
        if key != key.strip():
            raise user_error("--api-key has spaces around it; a client's Bearer token is read without them, so it "
                             "could never match", fix="pass the key without the spaces")
    found = tuple(k.strip() for k in (env or "").split(",") if k.strip())
    if env is not None and not found:
        raise user_error(f"${API_KEY_ENV} is set but holds no key",
                         fix="set it to the keys (comma-separated), or unset it to serve without keys")
    return (*flags, *found)


def load(spec: str, *, dtype: str = "auto", device: str = "auto") -> tuple[Any, Any]:
    """Model and tokenizer for a spec (``kvstate.models.load_model``'s dtype and device rules); tiny models
    get the in-memory character tokenizer."""
    from .. import models

    if spec.startswith("tiny:"):
        from ..models.tiny import QWEN_VL
        from ..models.tiny_tokenizer import QWEN_VL_TOKENS, tiny_tokenizer

        model, _ = models.load_model(spec, dtype=dtype, device=device)
        return model, tiny_tokenizer(QWEN_VL_TOKENS if spec.removeprefix("tiny:") in QWEN_VL else None)
    return models.load_model(spec, need_tokenizer="serve", dtype=dtype, device=device)


def image_processor(spec: str) -> Any:
    """The image processor for a spec's images: the tiny Qwen-VL one, a folder's own, or None."""
    if spec.startswith("tiny:"):
        from ..models.tiny import QWEN_VL
        from ..models.tiny_tokenizer import tiny_qwen_vl_image_processor

        return tiny_qwen_vl_image_processor() if spec.removeprefix("tiny:") in QWEN_VL else None
    if spec in ("default", "smollm2"):  # the embedded models read text only
        return None
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError, KeyError):  # a text-only model folder
        return None
