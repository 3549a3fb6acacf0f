"""``kvstate serve``: an OpenAI-compatible HTTP server whose conversations resume exactly.

Every request's rendered tokens continue the longest matching state: first an
in-memory pool of recent conversation states, then the prefix store (a folder or
Redis shared by restarts and other workers). Only the unmatched suffix is fed, and
the answer equals a fresh run on the whole history. ``docs/serve.md`` has the
routes, the parameter mapping, the limits and what runs in parallel.

    kvstate serve                                  # the embedded Gemma-3-270M on 127.0.0.1:8000
    kvstate serve --store redis://localhost:6379/0 --api-key "$KEY"

Needs the ``serve`` extra: ``pip install 'kvstate[serve]'``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Server", "Settings", "create_app", "run"]


def __getattr__(name: str) -> Any:  # torch and the store load on first use, not with the CLI's parser
    if name in ("Server", "Settings"):
        from . import server

        return getattr(server, name)
    raise AttributeError(name)


def create_app(server: Any) -> Any:
    """The FastAPI app for ``server`` (import-light: FastAPI loads only here)."""
    from .app import create_app as build

    return build(server)


def run(server: Any, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until SIGTERM or Ctrl-C (uvicorn; one process, one model), then stop gracefully: the listener
    closes, new requests get a 503, running ones finish or end within ``shutdown_timeout`` seconds
    (``Server.stop``), their states reach the store, and ``run`` returns (``kvstate serve`` exits 0)."""
    import gc

    import uvicorn

    from .shutdown import Draining

    app = create_app(server)
    # The objects of torch, transformers and the model live as long as the process: frozen, a full garbage
    # collection no longer walks them, and stalls no decode step (docs/benchmarks.md; the Python docs' advice
    # for a process that forks or runs long after start-up)
    gc.freeze()
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=server.settings.shutdown_timeout + Draining.MARGIN)
    try:
        Draining(config, server).run()
    finally:
        server.close()  # after the drain: waits for the model thread, whose jobs wrote the store
