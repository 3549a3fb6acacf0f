"""A 10-turn chat on the default model: `kvstate serve` against `transformers serve`, in one run.

Both servers load the same float32 folder (the embedded Gemma-3-270M, with kvstate's
fallback chat template written into its tokenizer config so both render the same
text), run one at a time with the same threads, and get the same requests through
the official ``openai`` client: a system prompt, then 10 user turns, each answered
greedily with ``max_tokens`` tokens and streamed. Per turn we record TTFT (request
sent to first content chunk) and total time. ``transformers serve`` re-prefills
the whole history every turn (its source notes prefix caching as a TODO), which is
what a skilled user of plain transformers gets over HTTP. Then kvstate is restarted
on the same folder store and asked an 11th turn, against a cold kvstate without a
store (a full re-prefill) on the same request.

    python bench/bench_serve.py            # about 4 minutes on 2 cores
    python bench/bench_serve.py --think 2  # a user who reads each answer for 2 s (results: serve_think2.json)

The TTFT ratio grows with the history: kvstate's TTFT is one forward over the new
turn (its floor, about 70 ms here, is one token through Gemma's 262k-vocabulary head),
while the plain server's grows with every token of the conversation. Under the canonical
schedule kvstate settles each reply after sending it: the answer as the template renders it is
fed again in canonical chunks up to where the next user turn's mark ("User:") will start, so the
next turn feeds only its own tokens (docs/exactness.md, "Turn marks"). With no pause between turns
(the default) the next request waits for that settle; with ``--think`` it runs while the user reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results

SYSTEM = (
    "You are a patient assistant for a small public library. You answer questions about opening hours, "
    "borrowing rules, the reading room, events for children and adults, and how to find books in the "
    "catalogue. Keep answers short and friendly. The library opens at nine in the morning and closes at six "
    "in the evening on weekdays, and at one in the afternoon on Saturdays; it is closed on Sundays and public "
    "holidays. Members may borrow up to eight books at a time for three weeks, and renew each loan twice unless "
    "another member has reserved the book. Late returns cost ten cents per book per day, capped at five dollars. "
    "The reading room is quiet; phone calls are not allowed there. Children's story time is on Wednesday at four, "
    "and the book club meets on the first Thursday of each month at seven. Wi-Fi is free, and the password is on "
    "the board by the entrance. Printing costs ten cents a page. Lost cards are replaced for two dollars.")
QUESTIONS = [
    "Hi! When are you open on Saturday?", "How many books can I borrow?", "And for how long?",
    "What if I return a book late?", "Is there anything for kids?", "When does the book club meet?",
    "Can I make a phone call in the reading room?", "How much is printing?", "I lost my card. What now?",
    "Thanks! Anything else I should know?", "One last thing: is the Wi-Fi free?"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(cmd: list[str], port: int, threads: int) -> Iterator[str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(proc, url)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait(proc: subprocess.Popen, url: str) -> None:
    import urllib.request

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("server did not start")


_CLIENTS: dict[str, object] = {}


def _client(url: str) -> object:
    """One ``openai`` client per server, as an application keeps one: a new client's first request sets up
    its connection (about 80 ms here), which would be counted in every turn's TTFT on both servers."""
    import openai

    if url not in _CLIENTS:
        _CLIENTS[url] = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    return _CLIENTS[url]


def _turn(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, object]:
    """One streamed greedy turn: TTFT, total seconds, the answer and (kvstate) the reused tokens."""
    api = _client(url)
    start = time.perf_counter()
    ttft, parts, cached = None, [], None
    stream = api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
        if getattr(chunk, "usage", None) is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return {"ttft_s": ttft, "total_s": time.perf_counter() - start, "answer": "".join(parts), "cached": cached}


def _chat(url: str, model: str, turns: int, max_tokens: int, think: float = 0.0,
          warmup: bool = True) -> list[dict[str, object]]:
    if warmup:  # loads lazily loaded models and warms kernels; shares no prefix beyond <bos> with the chat
        _turn(url, model, [{"role": "user", "content": "Hello"}], 2)
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    rows = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        if len(rows):
            time.sleep(think)  # the user reads the answer and types (the same pause for both servers)
        row = _turn(url, model, messages, max_tokens)
        messages.append({"role": "assistant", "content": str(row["answer"])})
        rows.append(row)
        print(f"  turn {len(rows):2d}: ttft {row['ttft_s']:.3f}s total {row['total_s']:.3f}s cached {row['cached']}",
              flush=True)
    return rows


def _model_folder(work: Path) -> Path:
    """The default model's folder, linked, with the fallback chat template in its tokenizer config."""
    from kvstate.serve.chat import FALLBACK_TEMPLATE
    from kvstate.testing.default_model import default_model_folder

    source, folder = default_model_folder(), work / "gemma-3-270m"
    folder.mkdir()
    for item in source.iterdir():
        (folder / item.name).symlink_to(item)
    (folder / "tokenizer_config.json").unlink()
    config = json.loads((source / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": FALLBACK_TEMPLATE}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (a short chat reply)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="both servers load the weights in this dtype (results: serve.json, serve_bfloat16.json)")
    parser.add_argument("--think", type=float, default=0.0, metavar="SECONDS",
                        help="pause between an answer and the next question (both servers; results: serve_thinkS.json)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvstate-bench-serve-"))
    try:
        folder = _model_folder(work)
        bin_dir = Path(sys.executable).parent
        kvstate = [sys.executable, "-m", "kvstate.cli", "serve", "--model", str(folder), "--log-level", "warning",
                   "--dtype", args.dtype]
        turns, n = args.turns + 1, args.turns
        port = _free_port()
        print("transformers serve:", flush=True)
        with _server([str(bin_dir / "transformers"), "serve", str(folder), "--port", str(port), "--dtype",
                      args.dtype, "--log-level", "warning", "--host", "127.0.0.1"], port, args.threads) as url:
            plain = _chat(url, str(folder), turns, args.max_tokens, args.think)
        store = str(work / "store")
        print("kvstate serve:", flush=True)
        port = _free_port()
        with _server([*kvstate, "--port", str(port), "--store", store], port, args.threads) as url:
            ours = _chat(url, folder.name, n, args.max_tokens, args.think)
        print("kvstate serve, restarted on the same store:", flush=True)
        port = _free_port()
        with _server([*kvstate, "--port", str(port), "--store", store], port, args.threads) as url:
            restarted = _last_turn(url, folder.name, ours, args.max_tokens)
        print("kvstate serve, cold (no store):", flush=True)
        port = _free_port()
        with _server([*kvstate, "--port", str(port)], port, args.threads) as url:
            cold = _last_turn(url, folder.name, ours, args.max_tokens)
        _report(args, plain, ours, restarted, cold)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _last_turn(url: str, model: str, ours: list[dict[str, object]], max_tokens: int) -> dict[str, object]:
    """Turn ``len(ours) + 1`` of the chat whose first turns were answered ``ours``."""
    _turn(url, model, [{"role": "user", "content": "Hello"}], 2)
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for question, row in zip(QUESTIONS, ours, strict=False):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": str(row["answer"])}]
    messages.append({"role": "user", "content": QUESTIONS[len(ours)]})
    row = _turn(url, model, messages, max_tokens)
    print(f"  turn {len(ours) + 1}: ttft {row['ttft_s']:.3f}s total {row['total_s']:.3f}s cached {row['cached']}")
    return row


def _report(args: argparse.Namespace, plain: list, ours: list, restarted: dict, cold: dict) -> None:
    n = args.turns
    rows = [{"turn": i + 1, "transformers_ttft_s": p["ttft_s"], "kvstate_ttft_s": o["ttft_s"],
             "ttft_ratio": p["ttft_s"] / o["ttft_s"], "transformers_total_s": p["total_s"],
             "kvstate_total_s": o["total_s"], "kvstate_cached_tokens": o["cached"],
             "same_answer": p["answer"] == o["answer"]} for i, (p, o) in enumerate(zip(plain, ours, strict=False))]
    result = {
        "what": f"10-turn streamed greedy chat on the default model (Gemma-3-270M, {args.dtype}), openai client, "
                f"{args.think:g} s between an answer and the next question",
        "dtype": args.dtype, "think_s": args.think,
        "max_tokens": args.max_tokens, "threads_per_server": args.threads, "turns": rows,
        "turn_10_ttft_ratio": rows[n - 1]["ttft_ratio"],
        "total_seconds": {"transformers": sum(p["total_s"] for p in plain[:n]),
                          "kvstate": sum(o["total_s"] for o in ours)},
        "answers_equal": all(r["same_answer"] for r in rows),
        "after_restart": {"turn": n + 1, "restarted_ttft_s": restarted["ttft_s"], "cold_ttft_s": cold["ttft_s"],
                          "transformers_ttft_s": plain[n]["ttft_s"],
                          "ratio_cold_over_restarted": cold["ttft_s"] / restarted["ttft_s"],
                          "restarted_cached_tokens": restarted["cached"],
                          "same_answer": restarted["answer"] == cold["answer"] == plain[n]["answer"]},
    }
    name = "serve" if args.dtype == "float32" else f"serve_{args.dtype}"
    write_results(name + (f"_think{args.think:g}" if args.think else ""), result)


if __name__ == "__main__":
    main()
