"""A graceful stop for ``kvstate serve``: uvicorn's server, with SIGTERM and Ctrl-C draining the model thread.

uvicorn alone closes the listener on SIGTERM, closes every idle keep-alive connection (no response: the
close is the HTTP signal for a client pool or a proxy to reconnect, elsewhere), lets a request in flight
finish with its connection closed after it, waits ``timeout_graceful_shutdown`` seconds, cancels what is
left (a stream in flight is cut mid-answer, its state never committed), and then raises the signal again,
so the process ends with status -15. ``Draining`` keeps the first three and starts ``Server.stop`` as its
shutdown begins (on the event loop, within uvicorn's 0.1 s tick of the signal): a request whose handler
starts after that gets a 503 (``/health`` says ``draining``), running ones stream on for
``Settings.shutdown_timeout`` seconds and then end at their next token with a finish chunk
(``finish_reason`` ``length``), each state committed to the pool and the store. uvicorn's own limit
comes ``MARGIN`` seconds later, for the last tokens to be sent; the signal is not raised again, so a stop
that drained is a clean exit (status 0). A second Ctrl-C still forces the exit, as in uvicorn.
``CloseWhileDraining`` marks every response that starts during the drain ``Connection: close``, so a
client or a proxy learns from the response that the connection ends, rather than at its next request.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn


class Draining(uvicorn.Server):
    """``uvicorn.Server`` whose shutdown starts ``server.stop()`` (a ``kvstate.serve.Server``) first."""

    MARGIN = 5.0  # seconds past the deadline before uvicorn cancels what is still open (a forward in flight)

    def __init__(self, config: uvicorn.Config, server: Any) -> None:
        super().__init__(config)
        self.kvstate = server

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """On the event loop, once the signal handler asked to exit (a handler only sets flags: taking a lock
        there could deadlock with the code it interrupted): start draining, then uvicorn's shutdown."""
        self.kvstate.stop()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's handlers for SIGINT and SIGTERM, without raising the signal again once the server stopped:
        the process drained, and exits with its own status."""
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


class CloseWhileDraining:
    """ASGI middleware: a response that starts once ``stopping`` is set carries ``Connection: close`` (uvicorn then
    closes the connection after it, as it does for any request in flight at the signal)."""

    def __init__(self, app: Any, stopping: threading.Event) -> None:
        self.app, self.stopping = app, stopping

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def closing(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and self.stopping.is_set():
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, closing)
