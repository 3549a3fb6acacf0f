"""Child Python processes for the tests, without paying the imports each time.

Tests that check "another process, a fresh model instance" (a state file loaded elsewhere, a store shared by two
workers, a server restarted on its store) used to start ``python -c CHILD`` or ``python -m kvstate.cli serve``:
3-5 s each on this machine, nearly all of it importing torch, transformers and the server's stack. ``run`` and
``spawn`` give the same isolation faster: a zygote process per test worker imports those modules once (and runs
no torch operation, so forking it is safe: no thread pool exists yet), and each child is ``os.fork``-ed from it.
The child is a new process with its own memory and its own model instance; nothing of the test process reaches
it but its arguments and environment. ``run`` is ``subprocess.run(capture_output=True)``; ``spawn`` is a
``subprocess.Popen`` (poll, wait, terminate, kill, communicate) for children that run beside the test, such as
servers. ``tests/test_serve_cli.py`` still starts one ``kvstate serve`` as users do, through the interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

PRELOAD = ("torch", "transformers", "kvstate", "kvstate.testing.tiny", "kvstate.io", "kvstate.cli",
           "kvstate.serve.app", "uvicorn")
ZYGOTE = r"""
import json, os, select, sys, traceback
for name in sys.argv[1:]:
    __import__(name)
channel = os.fdopen(os.dup(1), "w")
jobs, pending = {}, b""  # jobs: a running child's pid -> the file its exit code goes to


def child(job):
    channel.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(os.open(job["out"], os.O_WRONLY | os.O_TRUNC), 1)
    os.dup2(1 if job["err"] == job["out"] else os.open(job["err"], os.O_WRONLY | os.O_TRUNC), 2)  # 2>&1
    sys.stdin, sys.stdout, sys.stderr = (open(0), open(1, "w", closefd=False), open(2, "w", closefd=False))
    sys.argv = ["-c", *job["argv"]]
    if job["env"] is not None:
        os.environ.clear()
        os.environ.update(job["env"])
    if job["threads"]:
        sys.modules["torch"].set_num_threads(job["threads"])
    code = 0
    try:
        exec(compile(job["code"], "<child>", "exec"), {"__name__": "__main__"})
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def reap():
    while jobs:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        path = jobs.pop(pid)
        with open(path + ".part", "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.rename(path + ".part", path)  # whole or absent: the test polls for it


while True:
    ready, _, _ = select.select([0], [], [], 0.02 if jobs else None)
    reap()
    if not ready:
        continue
    data = os.read(0, 1 << 16)
    if not data:  # the test process is gone
        break
    pending += data
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(job)
        jobs[pid] = job["status"]
        channel.write(json.dumps({"pid": pid}) + "\n")
        channel.flush()
"""

_LOCK = threading.Lock()
_ZYGOTE: subprocess.Popen | None = None


def _zygote() -> subprocess.Popen:
    global _ZYGOTE
    if _ZYGOTE is None or _ZYGOTE.poll() is not None:
        _ZYGOTE = subprocess.Popen([sys.executable, "-c", ZYGOTE, *PRELOAD], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": _path()})
        atexit.register(_ZYGOTE.kill)
    return _ZYGOTE


def _path() -> str:
    """The test process's import path, so a child imports what the test would (the tests' helpers included)."""
    return os.pathsep.join(p for p in sys.path if p)


class Child:
    """A forked child of the zygote, with ``subprocess.Popen``'s verbs (the zygote is its parent and reaps it;
    its exit code arrives in a file). ``stdout`` / ``stderr``: its output files, opened for reading."""

    def __init__(self, args: list[str], pid: int, folder: tempfile.TemporaryDirectory, status: str, out: str,
                 err: str) -> None:
        self.args, self.pid, self._folder, self.returncode = args, pid, folder, None  # the folder lives with it
        self._status, self._out, self._err = status, out, err

    @property
    def stdout(self) -> IO[str]:
        return open(self._out)

    @property
    def stderr(self) -> IO[str]:
        return open(self._err)

    def poll(self) -> int | None:
        if self.returncode is None and os.path.exists(self._status):
            with open(self._status) as f:
                self.returncode = int(f.read())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not yet reaped: the pid is still this child's
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the child (killed after ``timeout``); its stdout and stderr."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        with self.stdout as o, self.stderr as e:
            return o.read(), e.read()


def spawn(code: str, *argv: str, env: dict[str, str] | None = None, threads: int | None = None,
          out: str | None = None, err: str | None = None) -> Child:
    """Start ``code`` as ``python -c code *argv`` would, in a forked child of the zygote; it runs beside the
    test. ``env``: its whole environment (default: the zygote's, the test worker's); ``OMP_NUM_THREADS`` there
    also sets its torch threads, as it would at start-up. ``threads``: its torch threads (default: from ``env``,
    else the zygote's). ``out`` / ``err``: files for its stdout / stderr (default: fresh files)."""
    folder = tempfile.TemporaryDirectory(prefix="kvstate-child-")
    status = os.path.join(folder.name, "status")  # the zygote writes the exit code here
    out = out or os.path.join(folder.name, "out")
    err = err or os.path.join(folder.name, "err")
    for path in (out, err):
        open(path, "a").close()
    if threads is None and env is not None and env.get("OMP_NUM_THREADS", "").isdigit():
        threads = int(env["OMP_NUM_THREADS"])
    with _LOCK:
        zygote = _zygote()
        assert zygote.stdin is not None and zygote.stdout is not None
        zygote.stdin.write(json.dumps({"code": code, "argv": list(argv), "out": out, "err": err, "env": env,
                                       "threads": threads, "status": status}) + "\n")
        zygote.stdin.flush()
        pid = json.loads(zygote.stdout.readline())["pid"]
    return Child(["-c", code, *argv], pid, folder, status, out, err)


def kvstate(*argv: str, env: dict[str, str] | None = None, out: str | None = None,
            err: str | None = None) -> Child:
    """``python -m kvstate.cli *argv`` in a forked child (``spawn``'s options): a server beside the test."""
    return spawn("import sys; from kvstate.cli import main; sys.exit(main())", *argv, env=env, out=out, err=err)


def run(code: str, *argv: str, check: bool = True, timeout: float = 300,
        threads: int | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` as ``python -c code *argv`` would, in a forked child of the zygote; its completed process.
    ``threads``: the child's torch threads (default: the zygote's, from the test worker's ``OMP_NUM_THREADS``)."""
    child = spawn(code, *argv, threads=threads)
    stdout, stderr = child.communicate(timeout)
    done = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)  # type: ignore[arg-type]
    if check and child.returncode != 0:
        raise subprocess.CalledProcessError(child.returncode, done.args, done.stdout, done.stderr)  # type: ignore[arg-type]
    return done
