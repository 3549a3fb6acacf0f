"""Many conversations at once: `kvstate serve` against `transformers serve --continuous-batching`.

Every server loads the same folder (the embedded Gemma-3-270M, with kvstate's fallback chat
template, as in ``bench_serve.py``), with the same threads, and gets the same workload through
the official ``openai`` client: ``N`` chats of ``--turns`` streamed greedy turns of
``--max-tokens`` tokens, each chat its own user (they share the library's system prompt).
Each server runs the workload one chat at a time, then with 8 and 16 chats at once; the batching
servers run ``--rounds`` times (3; every other round in reverse order), and each level reports its
median over the rounds, as this machine has slow periods of minutes that one run cannot tell from
the servers' own speed (per-round values are kept in the JSON). Per level
we record completion tokens per second (tokens of all answers over the wall time), p50 and p99
TTFT, whether every answer equals the answer the same request got one at a time, and any request
that failed (a stream cut by the server is recorded, and its chat stops there). The
contenders, side by side in one run:

* ``transformers serve --continuous-batching`` (paged attention, its own scheduler);
* ``kvstate serve`` (``--max-batch 1``, the default: one request at a time through ``Session``), alone only;
* ``kvstate serve --max-batch 16`` (the batch-invariant scheduler);
* ``kvstate serve --max-batch 16 --batch-invariance off``: the same scheduler with plain kernels. Its
  throughput over the default's is the invariance tax.

    python bench/bench_batch_serve.py                      # float32, about 10 minutes on 2 cores
    python bench/bench_batch_serve.py --dtype bfloat16     # results: batch_serve[_bfloat16].json
    python bench/bench_batch_serve.py --chats 8 --turns 1 --streams 8 --no-system --name batch_serve_single_turn
"""

from __future__ import annotations

import argparse
import concurrent.futures
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import QUESTIONS, SYSTEM, _free_port, _model_folder, _server, _turn
from common import write_results

NAMES = ["Ada", "Ben", "Chloe", "Dev", "Eva", "Finn", "Gia", "Hugo", "Ines", "Jon", "Kai", "Lena", "Milo", "Nora",
         "Omar", "Pia"]


def _chat(url: str, model: str, index: int, turns: int, max_tokens: int,
          system: bool = True) -> list[dict[str, object]]:
    """Chat ``index``: ``turns`` streamed greedy turns; one row per turn."""
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    rows = []
    for t in range(turns):
        question = QUESTIONS[(index + t) % len(QUESTIONS)]
        content = f"I am {NAMES[index % len(NAMES)]}. {question}" if t == 0 else question
        messages.append({"role": "user", "content": content})
        try:
            row = _turn(url, model, messages, max_tokens)
        except openai.APIError as exc:  # recorded, not hidden: transformers' CB stream sometimes drops a request
            rows.append({"ttft_s": None, "answer": "", "error": f"{type(exc).__name__}: {exc}", "chat": index,
                         "turn": t + 1})
            break  # the chat cannot go on without its answer
        messages.append({"role": "assistant", "content": str(row["answer"])})
        rows.append({**row, "chat": index, "turn": t + 1})
    return rows


def _level(url: str, model: str, streams: int, chats: int, turns: int, max_tokens: int,
           tokenizer: object, system: bool = True) -> dict[str, object]:
    """``chats`` chats, ``streams`` at a time: throughput, TTFT percentiles and every answer."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=streams) as pool:
        futures = [pool.submit(_chat, url, model, i, turns, max_tokens, system) for i in range(chats)]
        rows = [row for f in futures for row in f.result()]
    wall = time.perf_counter() - start
    tokens = sum(len(tokenizer.encode(str(r["answer"]), add_special_tokens=False)) for r in rows)  # type: ignore[attr-defined]
    ttfts = sorted(float(r["ttft_s"]) for r in rows if r["ttft_s"] is not None)  # type: ignore[arg-type]
    p99 = ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))]
    errors = [f"{r['chat']}/{r['turn']}: {r['error']}" for r in rows if r.get("error")]
    out = {"streams": streams, "requests": len(rows), "errors": errors, "completion_tokens": tokens, "wall_s": wall,
           "tokens_per_s": tokens / wall, "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": p99,
           "answers": {f"{r['chat']}/{r['turn']}": r["answer"] for r in rows}}
    print(f"  {streams:2d} at once: {out['tokens_per_s']:.1f} tok/s, TTFT p50 {out['ttft_p50_s']:.3f}s "
          f"p99 {p99:.3f}s, {tokens} tokens in {wall:.1f}s, {len(errors)} failed requests", flush=True)
    return out


def _server_levels(cmd: list[str], port: int, args: argparse.Namespace, model: str, tokenizer: object,
                   streams: list[int], alone: dict[str, object] | None = None) -> dict[str, object]:
    """One server's run: one chat at a time (unless ``alone``, its earlier run, is given), then each level."""
    with _server(cmd, port, args.threads) as url:
        _turn(url, model, [{"role": "user", "content": "Hello"}], 2)  # load and warm
        if alone is None:
            alone = _level(url, model, 1, args.chats, args.turns, args.max_tokens, tokenizer, not args.no_system)
        levels = [_level(url, model, n, args.chats, args.turns, args.max_tokens, tokenizer, not args.no_system)
                  for n in streams]
    for level in levels:
        level["answers_equal_alone"] = level["answers"] == alone["answers"]
        level["speedup_vs_alone"] = level["tokens_per_s"] / alone["tokens_per_s"]  # type: ignore[operator]
    return {"alone": alone, "levels": levels}


def main() -> None:
    import os

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--chats", type=int, default=16, help="chats in the workload (each level runs all)")
    parser.add_argument("--turns", type=int, default=2, help="streamed turns per chat")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 16], help="chats at once, per level")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-system", action="store_true",
                        help="no system prompt: each chat is one user message (the batching goal's 8-client shape)")
    parser.add_argument("--name", help="results file name (default batch_serve[_DTYPE])")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of every batching server; each level reports its median over them")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    work = Path(tempfile.mkdtemp(prefix="kvstate-bench-batch-"))
    try:
        folder = _model_folder(work)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        bin_dir = Path(sys.executable).parent
        plain = [sys.executable, "-m", "kvstate.cli", "serve", "--model", str(folder), "--log-level", "warning",
                 "--dtype", args.dtype]
        kvstate = [*plain, "--max-batch", str(max(args.streams))]
        contenders = {
            "kvstate_max_batch_1": (lambda port: [*plain, "--port", str(port)], folder.name),
            "transformers_cb": (lambda port: [str(bin_dir / "transformers"), "serve", str(folder), "--port",
                                              str(port), "--dtype", args.dtype, "--log-level", "warning", "--host",
                                              "127.0.0.1", "--continuous-batching"], str(folder)),
            "kvstate": (lambda port: [*kvstate, "--port", str(port)], folder.name),
            "kvstate_invariance_off": (lambda port: [*kvstate, "--port", str(port), "--batch-invariance", "off"],
                                       folder.name),
        }
        results: dict[str, dict] = {}
        # rounds: this machine has slow periods of minutes; each round runs every server again (the order
        # reversed every other round) and the report takes each level's median over the rounds
        for r in range(args.rounds):
            names = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for name in names:
                if r and name == "kvstate_max_batch_1":
                    continue  # the one-at-a-time server runs alone only, once
                cmd, model = contenders[name]
                print(f"{name} (round {r + 1} of {args.rounds}):", flush=True)
                port = _free_port()
                streams = [] if name == "kvstate_max_batch_1" else args.streams  # one at a time: alone only
                run = _server_levels(cmd(port), port, args, model, tokenizer, streams,
                                     results[name]["alone"] if r else None)
                if r:
                    results[name]["rounds"].append(run["levels"])
                else:
                    results[name] = {"alone": run["alone"], "rounds": [run["levels"]]}
        _report(args, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _merged(runs: list[dict]) -> dict[str, object]:
    """One level over the rounds: the median throughput and TTFTs, answers equal alone in every round."""
    def median(key: str) -> float:
        return statistics.median(float(run[key]) for run in runs)

    return {"tokens_per_s": median("tokens_per_s"), "ttft_p50_s": median("ttft_p50_s"),
            "ttft_p99_s": median("ttft_p99_s"), "speedup_vs_alone": median("speedup_vs_alone"),
            "answers_equal_alone": all(run["answers_equal_alone"] for run in runs),
            "errors": [e for run in runs for e in run["errors"]],
            "tokens_per_s_rounds": [run["tokens_per_s"] for run in runs]}


def _report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    summary = {}
    for i, n in enumerate(args.streams):
        ours, tf, off = (_merged([levels[i] for levels in results[name]["rounds"]])
                         for name in ("kvstate", "transformers_cb", "kvstate_invariance_off"))
        one = results["kvstate_max_batch_1"]["alone"]["tokens_per_s"]
        summary[str(n)] = {
            "kvstate_tokens_per_s": ours["tokens_per_s"], "transformers_cb_tokens_per_s": tf["tokens_per_s"],
            "kvstate_vs_transformers_cb": ours["tokens_per_s"] / tf["tokens_per_s"],
            "kvstate_vs_transformers_cb_rounds": [a / b for a, b in zip(
                ours["tokens_per_s_rounds"], tf["tokens_per_s_rounds"], strict=True)],
            "kvstate_tokens_per_s_rounds": ours["tokens_per_s_rounds"],
            "transformers_cb_tokens_per_s_rounds": tf["tokens_per_s_rounds"],
            "kvstate_invariance_off_tokens_per_s_rounds": off["tokens_per_s_rounds"],
            "kvstate_vs_kvstate_alone": ours["speedup_vs_alone"],
            "kvstate_vs_one_at_a_time_server": ours["tokens_per_s"] / one,
            "invariance_tax": 1 - ours["tokens_per_s"] / off["tokens_per_s"],
            "kvstate_answers_equal_alone": ours["answers_equal_alone"],
            "transformers_cb_answers_equal_alone": tf["answers_equal_alone"],
            "transformers_cb_failed_requests": len(tf["errors"]), "kvstate_failed_requests": len(ours["errors"]),
            "kvstate_ttft_p50_s": ours["ttft_p50_s"], "kvstate_ttft_p99_s": ours["ttft_p99_s"],
            "transformers_cb_ttft_p50_s": tf["ttft_p50_s"], "transformers_cb_ttft_p99_s": tf["ttft_p99_s"],
        }
        rounds = ", ".join(f"{x:.2f}" for x in summary[str(n)]["kvstate_vs_transformers_cb_rounds"])
        print(f"{n} streams (medians of {args.rounds} rounds): kvstate {ours['tokens_per_s']:.1f} tok/s "
              f"({ours['speedup_vs_alone']:.2f}x alone, {summary[str(n)]['kvstate_vs_one_at_a_time_server']:.2f}x "
              f"the one-at-a-time server, answers equal alone: {ours['answers_equal_alone']}), transformers CB "
              f"{tf['tokens_per_s']:.1f} tok/s (answers equal alone: {tf['answers_equal_alone']}), ratio "
              f"{summary[str(n)]['kvstate_vs_transformers_cb']:.2f} (rounds: {rounds}), invariance tax "
              f"{summary[str(n)]['invariance_tax']:.0%}")
    system = "without" if args.no_system else "with"
    result = {"what": f"{args.chats} chats x {args.turns} streamed greedy turns of {args.max_tokens} tokens on the "
                      f"default model (Gemma-3-270M, {args.dtype}), {system} the system prompt, one at a time and "
                      f"{args.streams} at once, each batching server {args.rounds} times (medians)",
              "dtype": args.dtype, "threads_per_server": args.threads, "rounds": args.rounds, "summary": summary,
              "servers": results}
    default = "batch_serve" if args.dtype == "float32" else f"batch_serve_{args.dtype}"
    write_results(args.name or default, result)


if __name__ == "__main__":
    main()
