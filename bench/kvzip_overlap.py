"""Which slots kvstate's KVzip keeps against those kvpress's ``KVzipPress`` kept, on the RULER contexts.

kvpress's worker (``bench/kvpress_worker.py``) saved the per-head slots each press kept at 50% for the
cross-check contexts (``bench/.ruler-cache/slots/smollm2/<context>/KVzip_0.5.safetensors``, written by
``bench/bench_ruler.py --cross-check``). For each such context this script prefills SmolLM2-135M once, runs
``KVzip(0.5, count="entries", prefix=mode)`` for each way of treating the chat template's prefix (the
system prompt), and compares the kept (layer, head, slot) entries with kvpress's: the Jaccard index and the
entries each side kept per layer. ``prefix="evict"`` is kvpress's own rule; ``"sink"`` is the reference
code's (kvstate's default); ``"reread"`` kvstate's earlier. Writes ``bench/results/kvzip_overlap.json``.

Run: ``python bench/kvzip_overlap.py [--contexts 1024/single/5,...] [--modes evict,sink,reread]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common import write_results
from kvpress_worker import load_slots
from ruler_kvstate import Runner

CACHE = Path(__file__).parent / ".ruler-cache"


def kept_mask(layer, shape: torch.Size) -> torch.Tensor:
    """``[H, S]`` bool: the uncompressed slots each KV head of a compressed layer still holds."""
    heads = layer.head_positions()[0]  # [H, S'], negative on padding
    mask = torch.zeros(shape, dtype=torch.bool)
    for h in range(heads.shape[0]):
        p = heads[h]
        mask[h, p[(p >= 0) & (p < shape[1])]] = True
    return mask


def compare(state, theirs: list[torch.Tensor]) -> dict:
    both = either = mine = kvpress = 0
    per_layer = []
    for layer, other in zip(state.layers, theirs, strict=True):
        ours = kept_mask(layer, other.shape)
        both += int((ours & other).sum())
        either += int((ours | other).sum())
        mine, kvpress = mine + int(ours.sum()), kvpress + int(other.sum())
        per_layer.append([int(ours.sum()), int(other.sum())])
    return {"jaccard": both / either, "entries_kvstate": mine, "entries_kvpress": kvpress,
            "per_layer_kvstate_kvpress": per_layer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="", help="comma-separated context ids (default: every one saved)")
    parser.add_argument("--modes", default="evict,sink,reread", help="KVzip prefix modes to compare")
    parser.add_argument("--slots-dir", type=Path, default=CACHE / "slots" / "smollm2")
    args = parser.parse_args()
    from kvstate import Session
    from kvstate.compress import KVzip

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    prompts = json.loads((CACHE / "smollm2.json").read_text())
    wanted = set(filter(None, args.contexts.split(",")))
    runner, rows = Runner("smollm2", None), []
    for ctx in prompts["contexts"]:
        saved = args.slots_dir / ctx["id"].replace("/", "_") / "KVzip_0.5.safetensors"
        if not saved.is_file() or (wanted and ctx["id"] not in wanted):
            continue
        theirs = load_slots(saved)
        base = Session(runner.model)
        base.extend(torch.tensor([ctx["context_ids"]]))
        for mode in args.modes.split(","):
            session = base.fork()
            session.compress(KVzip(0.5, count="entries", prefix=mode))
            row = {"context": ctx["id"], "prefix": mode, **compare(session.state, theirs)}
            print(f"{ctx['id']} prefix={mode}: Jaccard {row['jaccard']:.4f}", flush=True)
            rows.append(row)
    if not rows:
        raise SystemExit(f"no saved kvpress slots under {args.slots_dir}: run bench/bench_ruler.py --cross-check")
    modes = sorted({r["prefix"] for r in rows})
    summary = {m: {"contexts": sum(r["prefix"] == m for r in rows),
                   "min_jaccard": min(r["jaccard"] for r in rows if r["prefix"] == m),
                   "mean_jaccard": sum(r["jaccard"] for r in rows if r["prefix"] == m) /
                   sum(r["prefix"] == m for r in rows)} for m in modes}
    write_results("kvzip_overlap", {"summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
