"""One long prompt arrives while short chats stream: how long do the running streams wait?

Eight short chat prompts decode together on one ``kvstate.batch.Scheduler`` (default model, greedy).
A few steps in, one long prompt (the README's text, ``--long`` tokens) arrives, and two steps
later one more short prompt (its TTFT shows whether it waits for the long prefill). With
``prefill_tokens=None`` its whole prefill runs in one step, and every running stream waits for it;
with ``prefill_tokens=N`` it is fed in pieces of about N tokens a step, at cuts of the canonical
schedule, between the decode steps (the same forwards, so the same answer). Per setting: the
running streams' longest and p99 gap between two tokens, their tokens per second, the long
prompt's TTFT, and whether every answer (token ids and log-probabilities) equals the whole-prefill
run's. All settings run in one process, one after another, on the same weights.

    python bench/bench_batch_long_prompt.py            # a few minutes on 2 cores
    python bench/bench_batch_long_prompt.py --quick    # smoke: a short long prompt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_batch import prompts
from common import write_results

README = Path(__file__).parent.parent / "README.md"


def long_prompt(tokenizer: object, n: int) -> torch.Tensor:
    """``[n]`` ids: a user turn holding the README's text (repeated if short), cut to ``n`` tokens."""
    text = README.read_text()
    ids = tokenizer(f"<start_of_turn>user\nSummarize this.\n{text}")["input_ids"]  # type: ignore[operator]
    while len(ids) < n:
        ids = ids + ids
    return torch.tensor(ids[:n])


def run(model: object, short: list[torch.Tensor], long: torch.Tensor, extra: torch.Tensor, budget: int | None,
        tokens: int, arrival: int) -> dict[str, object]:
    from kvstate.batch import BatchRequest, Done, Scheduler, Token, batch_settings

    scheduler = Scheduler(model, batch_settings(model, max_batch=16, prefill_tokens=budget))  # type: ignore[arg-type]
    handles = [scheduler.submit(BatchRequest(x, max_new_tokens=tokens, stop_ids=())) for x in short]
    last: dict[int, float] = {}
    gaps: list[float] = []
    done: dict[int, object] = {}
    late, after, submitted = None, None, {}
    first: dict[int, float] = {}
    start, step = time.perf_counter(), 0
    while scheduler.busy:
        if step == arrival:
            late = scheduler.submit(BatchRequest(long, max_new_tokens=16, stop_ids=()))
            submitted[late] = time.perf_counter()
        if step == arrival + 2:
            after = scheduler.submit(BatchRequest(extra, max_new_tokens=16, stop_ids=()))
            submitted[after] = time.perf_counter()
        for event in scheduler.step():
            now = time.perf_counter()
            if isinstance(event, Token) and event.handle in handles:
                if event.handle in last:
                    gaps.append(now - last[event.handle])
                last[event.handle] = now
            elif isinstance(event, Token) and event.handle in submitted and event.handle not in first:
                first[event.handle] = now - submitted[event.handle]
            elif isinstance(event, Done):
                done[event.handle] = event.completion
        step += 1
    seconds = time.perf_counter() - start
    gaps.sort()
    answers = [(done[h].tokens, done[h].logprobs) for h in [*handles, late, after]]  # type: ignore[attr-defined]
    return {"prefill_tokens": budget, "seconds": seconds, "steps": step,
            "short_tokens_per_s": len(short) * tokens / seconds, "short_gap_max_s": gaps[-1],
            "short_gap_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "short_gap_p50_s": gaps[len(gaps) // 2], "long_ttft_s": first[late],  # type: ignore[index]
            "short_after_long_ttft_s": first[after], "answers": answers}  # type: ignore[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=int, default=3000, help="tokens of the long prompt")
    parser.add_argument("--tokens", type=int, default=48, help="tokens each short chat answers")
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 256], help="prefill_tokens settings")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a 300-token long prompt, 8 tokens")
    args = parser.parse_args()
    if args.quick:
        args.long, args.tokens, args.budgets = 300, 8, [128]
    from kvstate.models import load_default_model

    model, tokenizer = load_default_model(dtype=getattr(torch, args.dtype), progress=False)
    every = prompts(tokenizer, 9)
    short, extra, long = every[:8], every[8], long_prompt(tokenizer, args.long)
    run(model, short[:1], short[1], short[2], None, 2, 0)  # warm-up
    results = []
    for budget in [None, *args.budgets]:
        result = run(model, short, long, extra, budget, args.tokens, arrival=3)
        results.append(result)
        print({k: v for k, v in result.items() if k != "answers"}, flush=True)
    whole = results[0]["answers"]
    for result in results:
        result["answers_equal_whole_prefill"] = result.pop("answers") == whole
    name = "batch_long_prompt_quick" if args.quick else f"batch_long_prompt_{args.dtype}"
    write_results(name, {"model": "default (Gemma-3-270M)", "dtype": args.dtype, "short_streams": len(short),
                         "short_tokens": args.tokens, "long_prompt_tokens": args.long, "results": results})


if __name__ == "__main__":
    main()
