"""A real ``redis-server`` on loopback for the store tests (``.ci/run`` installs it)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server(folder: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``(url, process)`` of a fresh server; stopped on exit (if still running)."""
    import redis

    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed: apt-get install redis-server (.ci/run does)")
    port = free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(folder)], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)
