"""Fingerprint cost (every weight digested) on the real Gemma-3-270M, fp32, CPU.

* first computation: every byte of every parameter and buffer hashed (XXH3-64), plus the
  dtype-independent sample and the config hash;
* a repeat with nothing changed: the cached fingerprint after the version-counter check;
* after an in-place edit of one tensor: the check notices and recomputes.

Writes ``bench/results/fingerprint.json``. Run: ``python bench/bench_fingerprint.py``.
"""

from __future__ import annotations

import statistics
import time

import torch

from common import write_results
from kvstate.adapters.fingerprinting import _tensors, fingerprint
from kvstate.testing import load_default_model


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    torch.set_grad_enabled(False)
    model, _ = load_default_model()
    tensors = _tensors(model)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    first = timed(lambda: fingerprint(model))
    cached = statistics.median(timed(lambda: fingerprint(model)) for _ in range(200))
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)  # an in-place edit (even one that changes no value) bumps the version
    after_edit = timed(lambda: fingerprint(model))
    write_results("fingerprint", {
        "model": "gemma3-270m (fp32), CPU", "tensors": len(tensors), "bytes": nbytes,
        "first_s": first, "cached_s": cached, "after_inplace_edit_s": after_edit,
        "first_gb_per_s": nbytes / first / 1e9,
    })


if __name__ == "__main__":
    main()
