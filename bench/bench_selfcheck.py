"""Self-check cost: the equivalence probe run on the real Gemma-3-270M, fp32, CPU.

Gemma is a registered family, so kvstate never probes it in use; this runs the probe that an
unregistered architecture of its size would get the first time (then the verdict is cached),
and the one-forward K/V width check every structural model gets per instance.
Writes ``bench/results/selfcheck.json``. Run: ``python bench/bench_selfcheck.py``.
"""

from __future__ import annotations

import time

import torch

from common import write_results
from kvstate.selfcheck import kv_shapes, probe, structural_adapter
from kvstate.testing import load_default_model


def main() -> None:
    torch.set_grad_enabled(False)
    model, _ = load_default_model()
    structural_adapter(model)  # warm-up: first-call costs of the kernels
    start = time.perf_counter()
    adapter = structural_adapter(model)  # the layout forward
    layout = time.perf_counter() - start
    probe(model, adapter)
    verdict = probe(model, adapter)
    start = time.perf_counter()
    kv_shapes(model, adapter.with_mode(stepwise=verdict.mode == "stepwise", rollback=verdict.rollback))
    widths = time.perf_counter() - start
    write_results("selfcheck", {"model": "gemma3-270m (fp32, sdpa), CPU", "verdict": verdict.mode,
                                "rollback": verdict.rollback, "probe_s": verdict.seconds, "layout_s": layout,
                                "kv_widths_s": widths, "total_s": layout + verdict.seconds + widths})


if __name__ == "__main__":
    main()
