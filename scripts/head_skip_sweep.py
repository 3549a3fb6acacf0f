"""Every accepted model type: a feed's inner chunks skip the output head, and the state is the same bits.

For each type ``bench/results/coverage.json`` lists as exact (or exact-stepwise), a tiny random model
(``kvstate.models.shrink``) is fed 13 tokens two ways: one feed in canonical chunks of 4 (its inner
chunks run without the output head, ``kvstate._compat.generation.without_logits``), and one feed per chunk of 4
(each chunk the last of its feed, so each computes its logits). Every layer's tensors and the last
logits must be ``torch.equal``. Stepwise families (one token per forward after the first chunk) are fed
4 tokens and then the rest, against the rest one token per feed. Results: ``bench/results/head_skip_sweep.json``.

    python scripts/head_skip_sweep.py [--types a,b]     # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))


def same_state(a: object, b: object) -> bool:
    import torch

    layers = all(torch.equal(x, y) for la, lb in zip(a.layers, b.layers, strict=True)  # type: ignore[attr-defined]
                 for x, y in zip(la.tensors().values(), lb.tensors().values(), strict=True))
    return layers and torch.equal(a.last_logits, b.last_logits)  # type: ignore[attr-defined]


def check(model_type: str) -> dict[str, object]:
    import torch

    from kvstate import Session
    from kvstate.models.shrink import tiny_causal_lm

    model = tiny_causal_lm(model_type)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(4, min(vocab, 100), (1, 13), generator=torch.Generator().manual_seed(0))
    skipped, kept = Session(model, canonical_chunk=4), Session(model, canonical_chunk=0)
    stepwise = skipped._engine.binding.caps.stepwise
    if stepwise:  # after the first chunk these continue one token per forward: compare those forwards
        skipped.extend(ids[:, :4])
        skipped.extend(ids[:, 4:])
        pieces = [(0, 4), *((i, i + 1) for i in range(4, 13))]
    else:
        skipped.extend(ids)
        pieces = [(s, s + 4) for s in range(0, 13, 4)]
    for start, end in pieces:
        kept.extend(ids[:, start:end])
    return {"type": model_type, "stepwise": stepwise, "equal": same_state(skipped.state, kept.state)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: coverage.json's accepted ones)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    import torch

    from common import write_results

    torch.set_num_threads(1)
    coverage = json.loads((Path(__file__).parents[1] / "bench/results/coverage.json").read_text())["results"]
    types = args.types.split(",") if args.types else sorted(t for t, v in coverage.items()
                                                            if v["status"].startswith("exact"))
    rows = []
    for model_type in types:
        start = time.perf_counter()
        try:
            row = check(model_type)
        except Exception as exc:  # recorded: a type that cannot run the check is a finding, not a crash
            row = {"type": model_type, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    equal = sum(1 for r in rows if r.get("equal"))
    print(f"{equal} of {len(rows)} types: the same bits with inner heads skipped")
    write_results("head_skip_sweep", {"types": len(rows), "equal": equal, "rows": rows})


if __name__ == "__main__":
    main()
