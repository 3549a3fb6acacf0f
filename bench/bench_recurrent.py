"""Recurrent continuation: a 256-token turn after a 2,048-token history, Mamba, CPU.

Transformers 5.24 starts Mamba's selective scan from zeros on every multi-token chunk
(``mamba_selective_scan``: "Initial hidden state is not supported by the kernel path"), so a
plain cache-carrying chunk is wrong. kvstate hands the scan the cached state
(``kvstate._compat.scan``). Side by side, in one run, each continuing the same 2,048-token state:

* **kvstate, one chunk** (what kvstate does now: exact);
* **stepwise**: one token per forward, what kvstate did before (exact; the cheapest correct
  way with plain transformers' cache);
* **re-prefill** of the whole conversation in one chunk (exact: the other plain way);
* **plain one chunk** from transformers' cache (the same cost, wrong output: for reference).

Each is timed as the median of ``--repeats`` runs, with max |Δlogit| against the re-prefill.
Writes ``bench/results/recurrent.json``. Run: ``python bench/bench_recurrent.py``.
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import AutoModelForCausalLM, MambaConfig

from common import median_time, write_results
from kvstate import Session
from kvstate.adapters import RecurrentAdapter, register
from kvstate.adapters.base import registered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--history", type=int, default=2048)
    parser.add_argument("--turn", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    config = MambaConfig(hidden_size=256, num_hidden_layers=8, state_size=16, vocab_size=32000)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(10, 32000, (1, args.history + args.turn))
    history, turn = ids[:, :args.history], ids[:, args.history:]

    chunked = Session(model)
    chunked.extend(history)
    current = registered(model)
    register(("mamba",), RecurrentAdapter(stepwise=True, position_ids=False))  # the previous behaviour
    stepwise = Session(model, state=chunked.state)
    register(("mamba",), current)  # type: ignore[arg-type]
    cache = model(history, use_cache=True).cache

    exact = Session(model).extend(ids)
    outs = {
        "kvstate_chunk": chunked.fork().extend(turn),
        "stepwise": stepwise.fork().extend(turn),
        "plain_chunk": model(turn, use_cache=True, cache=copy.deepcopy(cache)).logits[:, -1],
    }
    seconds = {
        "kvstate_chunk": median_time(lambda: chunked.fork().extend(turn), args.repeats),
        "stepwise": median_time(lambda: stepwise.fork().extend(turn), args.repeats),
        "reprefill": median_time(lambda: Session(model).extend(ids), args.repeats),
        "plain_chunk": median_time(lambda: model(turn, use_cache=True, cache=copy.deepcopy(cache)), args.repeats),
    }
    write_results("recurrent", {
        "model": "Mamba, random weights (hidden 256, 8 layers, state 16, vocab 32000), fp32, CPU",
        "history": args.history, "turn": args.turn, "repeats": args.repeats, "seconds": seconds,
        "stepwise_over_kvstate_chunk": seconds["stepwise"] / seconds["kvstate_chunk"],
        "reprefill_over_kvstate_chunk": seconds["reprefill"] / seconds["kvstate_chunk"],
        "max_abs_dlogit_vs_reprefill": {k: (v - exact).abs().max().item() for k, v in outs.items()},
        "max_abs_reference_logit": exact.abs().max().item(),
    })


if __name__ == "__main__":
    main()
