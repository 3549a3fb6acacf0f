"""`kvstate serve` A/B in one run: servers from different sources or settings, on the same workloads, alternated.

Each contender is ``name=SRC:ARGS``: a ``kvstate serve`` run from the source tree ``SRC`` (``PYTHONPATH``;
``.`` is this checkout's ``src``) with extra options ``ARGS`` (say ``--max-batch 16``), on the default model
in float32 (the folder and template of ``bench_serve.py``). Every round starts each contender in turn (the
order reversed every other round, so a slow stretch of a shared machine falls on each) and runs:

* **chat**: ``bench_serve.py``'s system prompt and 10 streamed greedy turns of ``--max-tokens`` tokens, one
  client: each turn's TTFT, and decode speed (the answer's tokens over its time after the first token);
* **burst**: ``--burst`` chats sent at once, one streamed turn each (``bench_batch_serve.py``'s chats):
  completion tokens per second and TTFT percentiles.

The report gives, per contender, the median of each figure over the rounds and its spread (min, max), and
whether each contender's answers are the same in every round and the same as the first contender's.

    python bench/bench_serve_ab.py --contender before=/tmp/old/src: --contender after=.: --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_batch_serve import _level
from bench_serve import _chat, _free_port, _model_folder, _turn, _wait
from common import write_results

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _served(src: str, options: list[str], folder: Path, threads: int) -> Iterator[str]:
    """A ``kvstate serve`` of ``folder`` run from the source tree ``src``; yields its URL."""
    port = _free_port()
    path = str(ROOT / "src") if src in (".", "") else src
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "kvstate.cli", "serve", "--model", str(folder), "--log-level", "warning",
           "--port", str(port), *options]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(proc, url)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _commit(src: str) -> str:
    """The commit of the checkout ``src`` lies in (``unknown`` for a copy without git)."""
    where = ROOT if src in (".", "") else Path(src)
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _round(src: str, options: list[str], folder: Path, args: argparse.Namespace, tokenizer: object) -> dict:
    """One contender's run: the chat, then the burst."""
    model = folder.name
    with _served(src, options, folder, args.threads) as url:
        _turn(url, model, [{"role": "user", "content": "Hello"}], 2)  # load and warm
        rows = _chat(url, model, args.turns, args.max_tokens, warmup=False)
        burst = _level(url, model, args.burst, args.burst, 1, args.burst_tokens, tokenizer)
    decode = [len(tokenizer.encode(str(r["answer"]), add_special_tokens=False)) /  # type: ignore[attr-defined]
              max(float(r["total_s"]) - float(r["ttft_s"]), 1e-9) for r in rows]  # type: ignore[arg-type]
    return {"chat_ttft_s": [r["ttft_s"] for r in rows], "chat_warm_ttft_s": statistics.median(
                [float(r["ttft_s"]) for r in rows[1:]]),  # type: ignore[arg-type]
            "chat_first_ttft_s": rows[0]["ttft_s"], "chat_decode_tokens_per_s": statistics.median(decode),
            "chat_cached": [r["cached"] for r in rows], "chat_answers": [r["answer"] for r in rows],
            "burst_tokens_per_s": burst["tokens_per_s"], "burst_ttft_p50_s": burst["ttft_p50_s"],
            "burst_ttft_p99_s": burst["ttft_p99_s"], "burst_errors": burst["errors"], "burst_answers": burst["answers"]}


FIGURES = ["chat_first_ttft_s", "chat_warm_ttft_s", "chat_decode_tokens_per_s", "burst_tokens_per_s",
           "burst_ttft_p50_s", "burst_ttft_p99_s"]


def _summary(rounds: list[dict], first: list[dict]) -> dict:
    out: dict[str, object] = {}
    for key in FIGURES:
        values = [float(r[key]) for r in rounds]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}
    out["answers_same_every_round"] = all(r["chat_answers"] == rounds[0]["chat_answers"] and
                                          r["burst_answers"] == rounds[0]["burst_answers"] for r in rounds)
    out["answers_same_as_first_contender"] = all(
        r["chat_answers"] == f["chat_answers"] and r["burst_answers"] == f["burst_answers"]
        for r, f in zip(rounds, first, strict=True))
    out["chat_cached"] = rounds[0]["chat_cached"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contender", action="append", required=True, metavar="NAME=SRC:ARGS",
                        help="a server: its name, its source tree (. for this checkout) and its options")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=10, help="chat turns")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per chat answer")
    parser.add_argument("--burst", type=int, default=8, help="chats sent at once")
    parser.add_argument("--burst-tokens", type=int, default=32, help="tokens per burst answer")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="serve_ab", help="results name: bench/results/<out>.json")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    contenders = {}
    for spec in args.contender:
        name, _, rest = spec.partition("=")
        src, _, options = rest.partition(":")
        contenders[name] = (src, options.split())
    work = Path(tempfile.mkdtemp(prefix="kvstate-bench-ab-"))
    try:
        folder = _model_folder(work)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        runs: dict[str, list[dict]] = {name: [] for name in contenders}
        for r in range(args.rounds):
            names = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for name in names:
                print(f"{name} (round {r + 1} of {args.rounds}):", flush=True)
                runs[name].append(_round(*contenders[name], folder, args, tokenizer))
                row = runs[name][-1]
                print(f"  chat: first TTFT {row['chat_first_ttft_s']:.3f}s, warm TTFT {row['chat_warm_ttft_s']:.3f}s,"
                      f" decode {row['chat_decode_tokens_per_s']:.1f} tok/s; burst of {args.burst}: "
                      f"{row['burst_tokens_per_s']:.1f} tok/s", flush=True)
        first = runs[next(iter(contenders))]
        summary = {name: {"src_commit": _commit(src), "options": options, **_summary(runs[name], first)}
                   for name, (src, options) in contenders.items()}
        for name, s in summary.items():
            figures = ", ".join(f"{k} {s[k]['median']:.3f} [{s[k]['min']:.3f}, {s[k]['max']:.3f}]"  # type: ignore[index]
                                for k in FIGURES)
            print(f"{name}: {figures}; same answers as {next(iter(contenders))}: "
                  f"{s['answers_same_as_first_contender']}")
        write_results(args.out, {"args": vars(args), "summary": summary, "runs": runs})
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
