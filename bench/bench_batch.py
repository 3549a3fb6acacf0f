"""Batched decoding on the default model: throughput at 1, 8 and 16 concurrent streams, and the
invariance tax (what answers that never depend on the batch cost).

Each stream is a short, different chat prompt answered greedily with ``--tokens`` tokens; all
streams are submitted at once to one ``kvstate.batch.Scheduler``. Per setting we record
completion tokens per second, TTFT (submission to the stream's first token; the prompts admitted in
a step are prefilled together in one tiled forward) at p50 and p99, and
whether every stream's answer equals its answer alone (token ids and log-probabilities). Each
number of streams runs with invariance on (the default: tiled, packed forwards) and off (plain
kernels on exactly the running rows); the tax is ``1 - on / off`` in tokens per second. The
baseline is kvstate's one-at-a-time path: ``Session.generate`` per stream, one after another.

    python bench/bench_batch.py                    # minutes on 2 cores; the lead runs it
    python bench/bench_batch.py --quick            # smoke: 2 tokens, 1 and 2 streams
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results

TOPICS = ["the tides", "bread", "a lighthouse", "bees", "rain", "chess", "a violin", "glaciers", "owls", "maps",
          "copper", "tea", "comets", "bridges", "ferns", "salt"]


def prompts(tokenizer: object, n: int) -> list[torch.Tensor]:
    """Gemma's chat format written out (the GGUF tokenizer has no template)."""
    texts = [f"<start_of_turn>user\nWrite two sentences about {topic}.<end_of_turn>\n<start_of_turn>model\n"
             for topic in TOPICS[:n]]
    return [torch.tensor(tokenizer(text)["input_ids"]) for text in texts]  # type: ignore[operator]


def run(model: object, ids: list[torch.Tensor], tokens: int, invariant: bool, rows: int) -> dict[str, object]:
    from kvstate.batch import BatchRequest, Done, Scheduler, Token, batch_settings

    scheduler = Scheduler(model, batch_settings(model, max_batch=len(ids), rows=rows, invariant=invariant))  # type: ignore[arg-type]
    start = time.perf_counter()
    handles = [scheduler.submit(BatchRequest(x, max_new_tokens=tokens, stop_ids=())) for x in ids]
    first: dict[int, float] = {}
    done = {}
    for event in scheduler.run():
        if isinstance(event, Token):
            first.setdefault(event.handle, time.perf_counter() - start)
        elif isinstance(event, Done):
            done[event.handle] = event.completion
    seconds = time.perf_counter() - start
    ttft = sorted(first.values())
    return {"seconds": seconds, "tokens_per_second": len(ids) * tokens / seconds,
            "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "answers": [(done[h].tokens, done[h].logprobs) for h in handles]}


def one_at_a_time(model: object, ids: list[torch.Tensor], tokens: int) -> dict[str, float]:
    from kvstate import Session

    start = time.perf_counter()
    for x in ids:
        Session(model).generate(x[None], max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)  # type: ignore[arg-type]
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens_per_second": len(ids) * tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 tokens, 1 and 2 streams")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.tokens = [1, 2], 2
    from kvstate.models import load_default_model

    model, tokenizer = load_default_model(dtype=getattr(torch, args.dtype), progress=False)
    every = prompts(tokenizer, max(args.streams))
    alone = {invariant: [run(model, [x], args.tokens, invariant, args.rows)["answers"][0] for x in every]  # type: ignore[index]
             for invariant in (True, False)}
    rows = []
    for n in args.streams:
        row: dict[str, object] = {"streams": n, "one_at_a_time": one_at_a_time(model, every[:n], args.tokens)}
        for invariant in (True, False):
            result = run(model, every[:n], args.tokens, invariant, args.rows)
            answers = result.pop("answers")
            result["each_equals_alone"] = answers == alone[invariant][:n]
            row["invariant" if invariant else "plain"] = result
        on, off = row["invariant"]["tokens_per_second"], row["plain"]["tokens_per_second"]  # type: ignore[index]
        row["invariance_tax"] = 1 - on / off
        row["speedup_over_one_at_a_time"] = on / row["one_at_a_time"]["tokens_per_second"]  # type: ignore[index]
        rows.append(row)
        print(row, flush=True)
    name = "batch_quick" if args.quick else f"batch_{args.dtype}"
    write_results(name, {"model": "default (Gemma-3-270M)", "dtype": args.dtype, "tokens": args.tokens,
                         "rows": args.rows, "results": rows})


if __name__ == "__main__":
    main()
