"""Child Python processes for the tests, without paying the imports each time.

Tests that check "another process, a fresh model instance" (a state file loaded elsewhere, a store shared by two
workers) used to start ``python -c CHILD``: 3-4 s each on this machine, nearly all of it importing torch and
transformers. ``run`` gives the same isolation faster: a zygote process per test worker imports those modules once
(and runs no torch operation, so forking it is safe: no thread pool exists yet), and each child is ``os.fork``-ed
from it. The child is a new process with its own memory and its own model instance; nothing of the test process
reaches it but its arguments. Its stdout and stderr are captured as ``subprocess.run(capture_output=True)`` does.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading

PRELOAD = ("torch", "transformers", "kvstate", "kvstate.testing.tiny", "kvstate.io")
ZYGOTE = r"""
import json, os, sys, traceback
for name in sys.argv[1:]:
    __import__(name)
channel = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the child: its own stdin, stdout and stderr, then the script
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, job["out"]), (2, job["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
        sys.stdin, sys.stdout, sys.stderr = (open(0), open(1, "w", closefd=False), open(2, "w", closefd=False))
        sys.argv = ["-c", *job["argv"]]
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
    channel.write(json.dumps({"pid": pid}) + "\n")
    channel.flush()
    _, status = os.waitpid(pid, 0)
    channel.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
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


def run(code: str, *argv: str, check: bool = True, timeout: float = 300,
        threads: int | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` as ``python -c code *argv`` would, in a forked child of the zygote; its completed process.
    ``threads``: the child's torch threads (default: the zygote's, from the test worker's ``OMP_NUM_THREADS``)."""
    with _LOCK, tempfile.TemporaryDirectory(prefix="kvstate-child-") as folder:
        out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
        for path in (out, err):
            open(path, "w").close()
        zygote = _zygote()
        assert zygote.stdin is not None and zygote.stdout is not None
        zygote.stdin.write(json.dumps({"code": code, "argv": list(argv), "out": out, "err": err,
                                        "threads": threads}) + "\n")
        zygote.stdin.flush()
        pid = json.loads(zygote.stdout.readline())["pid"]
        timer = threading.Timer(timeout, os.kill, (pid, 9))
        timer.start()
        try:
            returncode = json.loads(zygote.stdout.readline())["code"]
        finally:
            timer.cancel()
        with open(out) as o, open(err) as e:
            done = subprocess.CompletedProcess(["-c", code, *argv], returncode, o.read(), e.read())
    if check and returncode != 0:
        raise subprocess.CalledProcessError(returncode, done.args, done.stdout, done.stderr)
    return done
