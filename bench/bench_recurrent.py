"""Recurrent continuation (issue 12): a 256-token turn after a 2,048-token history, Mamba, CPU.

Transformers 5.24 drops the recurrent state on multi-token chunks for Mamba, Jamba and
RecurrentGemma: their slow paths start the selective scan (or the conv window) from zeros
(``mamba_selective_scan``: "Initial hidden state is not supported by the kernel path").
kvstate therefore continues them one token per forward. Side by side, in one run:

* **stepwise** (what kvstate does, exact);
* **one chunk from the cache** (what plain transformers does: the same forward cost a
  multi-token continuation with an initial state would have, but its output is wrong);
* **re-prefill** of the whole conversation in one chunk (exact, the other exact choice).

The ratio stepwise / one-chunk bounds what multi-token continuation could gain here.
Writes ``bench/results/recurrent.json``. Run: ``python bench/bench_recurrent.py``.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import AutoModelForCausalLM, MambaConfig

from common import write_results
from kvstate import Session
from kvstate._compat import CACHE_KWARG


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history", type=int, default=2048)
    parser.add_argument("--turn", type=int, default=256)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    config = MambaConfig(hidden_size=256, num_hidden_layers=8, state_size=16, vocab_size=32000)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(10, 32000, (1, args.history + args.turn))
    base = Session(model)
    base.extend(ids[:, :args.history])
    with torch.no_grad():
        cache = getattr(model(ids[:, :args.history], use_cache=True), CACHE_KWARG)
    stepwise = timed(lambda: base.fork().extend(ids[:, args.history:]))
    one_chunk = timed(lambda: model(ids[:, args.history:], use_cache=True, **{CACHE_KWARG: copy.deepcopy(cache)}))
    reprefill = timed(lambda: Session(model).extend(ids))
    exact = Session(model)
    exact.extend(ids)
    s = base.fork()
    err_chunk = (model(ids[:, args.history:], use_cache=True, **{CACHE_KWARG: copy.deepcopy(cache)}).logits[:, -1]
                 - exact.state.last_logits).abs().max().item()
    err_step = (s.extend(ids[:, args.history:]) - exact.state.last_logits).abs().max().item()
    write_results("recurrent", {
        "model": "Mamba, random weights (hidden 256, 8 layers, state 16), fp32, CPU",
        "history": args.history, "turn": args.turn,
        "stepwise_s": stepwise, "one_chunk_s": one_chunk, "reprefill_s": reprefill,
        "stepwise_over_one_chunk": stepwise / one_chunk, "reprefill_over_stepwise": reprefill / stepwise,
        "max_abs_dlogit_one_chunk": err_chunk, "max_abs_dlogit_stepwise": err_step,
    })


if __name__ == "__main__":
    main()
