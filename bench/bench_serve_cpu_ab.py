"""The server's model thread in process CPU time, for an A/B between two kvstate sources on a loaded machine.

One in-process ``kvstate serve`` ``Server`` on the default model (fp32, one thread, ``--max-batch`` as given) answers
the same completions prompt (a 200-token text, greedy, no stop string) again and again: first for one token (a warm
request: the pool holds the prompt, so this is the prefill of its tail and the first token: the TTFT's work), then
for ``--tokens`` tokens; per answer token is the difference over the extra tokens. Each request's process CPU time
is taken around ``runner.submit(job).result()``, after ``runner.drain()`` (settles done), medians of ``--repeats``.
With ``--burst N`` it measures batched decoding instead: N different warm prompts submitted at once (run at
``--max-batch N``), ``--tokens`` each; the burst's process CPU time per answer token, medians of ``--repeats``.
Prints one JSON line; run it once per source, alternating, with ``PYTHONPATH`` naming the source:

    for i in 1 2; do for src in /tmp/old/src src; do PYTHONPATH=$src python bench/bench_serve_cpu_ab.py; done; done
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kvstate
from kvstate.serve import Server, Settings
from kvstate.serve.cli import load
from kvstate.serve.params import COMPLETION_FIELDS, parse
from kvstate.serve.runner import Job

PROMPT = ("The library opens at nine in the morning and closes at six in the evening on weekdays, and at one in the "
          "afternoon on Saturdays; it is closed on Sundays and public holidays. Members may borrow up to eight books "
          "at a time for three weeks, and renew each loan twice unless another member has reserved the book. Late "
          "returns cost ten cents per book per day, capped at five dollars. The reading room is quiet; phone calls are "
          "not allowed there. Children's story time is on Wednesday at four, and the book club meets on the first "
          "Thursday of each month at seven. Here is a short story about the library's oldest book:")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--burst", type=int, default=0, help="N prompts at once: batched decoding's CPU time")
    args = parser.parse_args()
    if args.burst:
        return burst(args)
    torch.set_num_threads(1)
    model, tokenizer = load("default")
    server = Server(model, tokenizer, "m", Settings(max_batch=args.max_batch))

    def answer(tokens: int) -> tuple[float, int]:
        prompt, inputs = server.render(PROMPT, False)
        request = parse({"model": "m", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}, COMPLETION_FIELDS,
                        server.limits, prompt.default_stop, 16)
        server.runner.drain()
        start = time.process_time()
        result = server.runner.submit(Job("default", prompt, request, inputs)).result()
        return time.process_time() - start, result.completion_tokens

    try:
        answer(1)
        answer(args.tokens)  # warm both paths (and the pool)
        first = [answer(1)[0] for _ in range(args.repeats)]
        runs = [answer(args.tokens) for _ in range(args.repeats)]
    finally:
        server.close()
    one, many = statistics.median(first), statistics.median(c for c, _ in runs)
    n = runs[0][1]
    print(json.dumps({"source": kvstate.__file__, "max_batch": args.max_batch, "warm_first_token_cpu_s": one,
                      "cpu_ms_per_answer_token": (many - one) / (n - 1) * 1000, "answer_tokens": n,
                      "first_s": first, "runs_s": [c for c, _ in runs]}))


def burst(args: argparse.Namespace) -> None:
    """``--burst N``: N warm prompts (each its own text) submitted together; CPU time per answer token."""
    torch.set_num_threads(1)
    model, tokenizer = load("default")
    server = Server(model, tokenizer, "m", Settings(max_batch=args.max_batch))
    texts = [f"Note {i}: " + PROMPT for i in range(args.burst)]

    def once() -> tuple[float, int]:
        jobs = []
        for text in texts:
            prompt, inputs = server.render(text, False)
            request = parse({"model": "m", "prompt": text, "max_tokens": args.tokens, "temperature": 0},
                            COMPLETION_FIELDS, server.limits, prompt.default_stop, 16)
            jobs.append(Job("default", prompt, request, inputs))
        server.runner.drain()
        start = time.process_time()
        results = [future.result() for future in [server.runner.submit(job) for job in jobs]]
        return time.process_time() - start, sum(r.completion_tokens for r in results)

    try:
        once()  # warm: the pool holds every prompt
        runs = [once() for _ in range(args.repeats)]
    finally:
        server.close()
    per_token = [cpu / tokens * 1000 for cpu, tokens in runs]
    print(json.dumps({"source": kvstate.__file__, "max_batch": args.max_batch, "burst": args.burst,
                      "cpu_ms_per_answer_token": statistics.median(per_token), "answer_tokens": runs[0][1],
                      "runs_s": [cpu for cpu, _ in runs]}))


if __name__ == "__main__":
    main()
