"""Per-token decode of ``Session.generate`` against plain ``model.generate``, in process CPU time, for an A/B between
two kvstate sources on a machine other processes load (wall time there follows the neighbours, CPU time much less).

The default model (fp32, one thread) continues the same 256-token history greedily for 24 tokens, and for one;
per token is the difference over 23, so prefill and per-call costs cancel; medians of 3 interleaved rounds.
Prints one JSON line; run it once per source, alternating, with ``PYTHONPATH`` naming the source:

    for i in 1 2; do for src in /tmp/old/src src; do PYTHONPATH=$src python bench/bench_decode_cpu_ab.py; done; done
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch

import kvstate
from kvstate import Session
from kvstate.models import load_model

N = 24


def main() -> None:
    torch.set_num_threads(1)
    model, _ = load_model("default")
    ids = torch.randint(10, 200000, (1, 256), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(ids)
    fns: dict[str, Callable[[], object]] = {
        "plain": lambda: model.generate(ids, attention_mask=ones, max_new_tokens=N, min_new_tokens=N, do_sample=False),
        "kvstate": lambda: Session(model).generate(ids, max_new_tokens=N, min_new_tokens=N, do_sample=False),
        "plain_1": lambda: model.generate(ids, attention_mask=ones, max_new_tokens=1, do_sample=False),
        "kvstate_1": lambda: Session(model).generate(ids, max_new_tokens=1, do_sample=False),
    }
    for fn in fns.values():
        fn()  # warm every path first
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(3):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            samples[name].append(time.process_time() - start)
    med = {name: statistics.median(values) for name, values in samples.items()}

    def per_token(name: str) -> float:
        return (med[name] - med[f"{name}_1"]) / (N - 1) * 1000

    ours, plain = per_token("kvstate"), per_token("plain")
    print(json.dumps({"source": kvstate.__file__, "kvstate_cpu_ms_per_token": ours, "plain_cpu_ms_per_token": plain,
                      "overhead_pct": 100 * (ours / plain - 1), "samples_s": samples}))


if __name__ == "__main__":
    main()
