"""Core benchmark (issue 2) on the real Gemma-3-270M, CPU, fp32. Ratios measured side by side.

* TTFT: re-prefilling a 1,024-token prompt vs resuming from an in-memory ``State``
  (the prompt itself, first token from stored logits; and a new 8-token turn after it);
* fork: ``Session.fork()`` vs ``copy.deepcopy`` of the equivalent ``DynamicCache``;
* decode tokens/s: ``Session.generate`` vs plain ``model.generate`` (overhead %).

Writes ``bench/results/core.json``. Run: ``python bench/bench_core.py [--prompt-tokens N]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from kvstate import Session
from kvstate.testing import load_default_model

RESULTS = Path(__file__).parent / "results"


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def prompt_ids(tokenizer, n: int) -> torch.Tensor:
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog near river {i % 17}."
                    for i in range(n))
    return tokenizer(text, return_tensors="pt").input_ids[:, :n]


def bench_ttft(model, ids, repeats):
    """First token: full prefill vs from a state that already holds the prompt."""
    def prefill():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)

    session = Session(model)
    session.extend(ids)
    base = session.fork()

    def resume():
        s = base.fork()
        s.generate(ids, max_new_tokens=1, do_sample=False)

    turn = torch.cat([ids, ids[:, 1:9]], 1)  # a new 8-token chat turn after the cached prompt

    def prefill_turn():
        model.generate(turn, attention_mask=torch.ones_like(turn), max_new_tokens=1, do_sample=False)

    def resume_turn():
        s = base.fork()
        s.generate(turn, max_new_tokens=1, do_sample=False)

    cold, warm = timed(prefill, repeats), timed(resume, repeats * 5)
    cold_turn, warm_turn = timed(prefill_turn, repeats), timed(resume_turn, repeats * 5)
    return {"prefill_s": statistics.median(cold), "resume_s": statistics.median(warm),
            "ratio": statistics.median(cold) / statistics.median(warm),
            "new_turn_prefill_s": statistics.median(cold_turn),
            "new_turn_resume_s": statistics.median(warm_turn),
            "new_turn_ratio": statistics.median(cold_turn) / statistics.median(warm_turn)}


def bench_fork(model, ids, repeats):
    """Session.fork() vs copy.deepcopy of the DynamicCache transformers builds for the prompt."""
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    session = Session(model)
    session.extend(ids)
    deep = timed(lambda: copy.deepcopy(cache), repeats)
    fork = timed(session.fork, repeats * 20)
    kv_bytes = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    return {"deepcopy_s": statistics.median(deep), "fork_s": statistics.median(fork),
            "ratio": statistics.median(deep) / statistics.median(fork), "kv_bytes": kv_bytes,
            "state_bytes": session.state.nbytes}


def bench_decode(model, ids, new_tokens, repeats):
    """Decode speed over the same prompt: both include one identical prefill."""
    mask = torch.ones_like(ids)

    def plain():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)

    def ours():
        Session(model).generate(ids, max_new_tokens=new_tokens, do_sample=False)

    p, o = [], []
    for _ in range(repeats):  # interleaved, so drift hits both alike
        p += timed(plain, 1)
        o += timed(ours, 1)
    tp, to = statistics.median(p), statistics.median(o)
    return {"plain_s": tp, "kvstate_s": to, "plain_tok_s": new_tokens / tp,
            "kvstate_tok_s": new_tokens / to, "overhead_pct": 100 * (to - tp) / tp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    result = {
        "model": "gemma3-270m (fp32, sdpa)", "prompt_tokens": ids.shape[1],
        "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
        "ttft": bench_ttft(model, ids, args.repeats),
        "fork": bench_fork(model, ids, args.repeats),
        "decode": bench_decode(model, ids[:, :128], args.new_tokens, args.repeats),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "core.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
