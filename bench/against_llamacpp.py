"""`kvstate verify --against` on llama-cpp-python's OpenAI server, prompt cache on.

The server (``pip install 'llama-cpp-python[server]'``, from the package index) loads the
embedded default model's GGUF (Gemma-3-270M Q4_K_M, ``kvstate.models.default.gguf_path``)
with its prompt cache on (``--cache true``, in RAM). There is no ``--cold`` twin: this
server cannot turn off the reuse of the previous prompt's prefix, so the cold reference is
each request's first occurrence (the weakest, stated in the report). The JSON report goes to
``bench/results/against_llamacpp.json`` and its Markdown to ``bench/results/against_llamacpp.md``,
whatever it finds, with the server's peak resident memory. Its RAM cache (``--cache_type ram``) grew by
about 320 MiB a request here, beyond ``--cache_size``: with ``--n_ctx 8192`` the kernel killed the server
after about 70 requests, and with 3072 it held 16 GB after 41. So the cache is on disk by default
(``--cache-type``), in a temporary folder, and the context is 3072 (the long prompt fits).

    python bench/against_llamacpp.py --server-python /path/to/venv/bin/python   # about 20 minutes on 2 cores

``--server-python`` is the interpreter that has llama-cpp-python (default: this one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_results


class Watch:
    """The server's resident memory, sampled every second (its RAM prompt cache grows per request), and how it
    ended."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_kb, self.samples, self.exit = pid, 0, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(OSError, ValueError, IndexError):
                status = Path(f"/proc/{self.pid}/status").read_text()
                rss = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
                self.peak_kb, self.samples = max(self.peak_kb, rss), self.samples + 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def llama_server(python: str, gguf: Path, port: int, threads: int, n_ctx: int, cache_type: str,
                 log: Path) -> Iterator[tuple[str, Watch]]:
    """llama-cpp-python's server on loopback, prompt cache on (its disk cache lives in a temporary folder);
    yields its base URL and memory watch."""
    command = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--cache", "true", "--cache_type", cache_type,
               "--seed", "0"]
    folder = tempfile.TemporaryDirectory(prefix="kvstate-llama-cache-")
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   cwd=folder.name)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited ({process.returncode}); see {log}")
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            time.sleep(1)
        else:
            raise RuntimeError(f"the server did not answer within 180 s; see {log}")
        watch = Watch(process.pid)
        yield url, watch
        watch.stop()
        watch.exit = process.poll()  # None: still running; -9: killed (the kernel's OOM killer, here)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
        folder.cleanup()


def _version(python: str) -> str:
    script = "import importlib.metadata as m; print(m.version('llama-cpp-python'))"
    return subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=60).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server-python", default=sys.executable, help="interpreter with llama-cpp-python[server]")
    parser.add_argument("--port", type=int, default=18080)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--cache-type", choices=("disk", "ram"), default="disk",
                        help="the prompt cache's tier (default disk: the RAM one outgrew this machine, see above)")
    parser.add_argument("--n-ctx", type=int, default=3072, help="the server's context (default 3072: the long "
                        "prompt fits, and the RAM cache, which keeps a whole context per request, fits in memory)")
    parser.add_argument("--time-limit", type=float, default=1500.0,
                        help="seconds (default 1500: this CPU needs about 20 minutes for every scenario)")
    args = parser.parse_args()

    from kvstate.models.default import gguf_path
    from kvstate.verify.against import Options, run_against

    gguf = gguf_path(progress=True)
    RESULTS.mkdir(exist_ok=True)
    log = RESULTS / "against_llamacpp.log"
    with llama_server(args.server_python, gguf, args.port, args.threads, args.n_ctx, args.cache_type,
                      log) as (url, watch):
        options = Options(url, max_tokens=args.new_tokens, time_limit=args.time_limit)
        report = run_against(options, progress=lambda text: print(f"[against] {text}", file=sys.stderr))
    print(report.table(), file=sys.stderr)
    server = {"package": "llama-cpp-python", "version": _version(args.server_python), "gguf": gguf.name,
              "flags": f"--n_ctx {args.n_ctx} --cache true --cache_type {args.cache_type} --seed 0",
              "threads": args.threads,
              "cold": "none (--cold off): each request's first occurrence",
              "peak_rss_mib": round(watch.peak_kb / 1024), "exit_status_after_run": watch.exit}
    write_results("against_llamacpp", {"server": server,
                                       "options": {"new_tokens": args.new_tokens, "time_limit": args.time_limit},
                                       "report": report.to_dict()})
    (RESULTS / "against_llamacpp.md").write_text(report.markdown())
    print(json.dumps({"outcome": report.outcome, "exit_code": report.exit_code}))


if __name__ == "__main__":
    main()
