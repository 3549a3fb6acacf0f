"""Question-aware compression on a hybrid model: how the budget splits between full and sliding layers.

Gemma-3-270M retrieves through its three full-attention layers (5, 11, 17); the other fifteen slide over
512 tokens. ``SnapKV(kernel=21)`` at 25% kept evicts 75% of every layer alone, full and sliding alike. This
sweep keeps the same total (25% of the entries the layers read: every slot of a full layer, the last
``window - 1`` of a sliding one) but gives the full layers ``--keep-full`` of their slots and the sliding
layers the rest (per layer, through ``Policy.ratio_for``; at least 20 slots per sliding layer), each
question compressing its own fork with its own attention, as ``bench_ruler.py``'s question-aware runs do.
It reads the prompt ids ``bench_ruler.py`` wrote (``bench/.ruler-cache/gemma3.json``) and the suite's
references, and writes ``bench/results/ruler_aware_split.json``. Run:
``python bench/ruler_aware_split.py --keep-full 0.25 0.5 0.75 0.9 --contexts <ids>``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from common import write_results
from ruler_kvstate import Runner, kv_bytes
from ruler_tasks import string_match_all

HERE = Path(__file__).resolve().parent


def split_policy(full_layers: frozenset[int], ratio_full: float, ratio_sliding: float) -> object:
    from kvstate.compress import SnapKV

    @dataclass(frozen=True)
    class Split(SnapKV):
        """SnapKV whose ratio depends on the layer's kind (full attention or sliding)."""

        def ratio_for(self, layer: int, n_layers: int) -> float:
            return ratio_full if layer in full_layers else ratio_sliding

    return Split(0.75, window=16, kernel=21)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep-full", type=float, nargs="+", default=[0.25, 0.5, 0.75, 0.9])
    parser.add_argument("--contexts", default="", help="context ids (default: every 1k context)")
    parser.add_argument("--share", type=float, default=0.25, help="share of the entries kept in all")
    parser.add_argument("--name", default="ruler_aware_split", help="results file bench/results/<name>.json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    runner = Runner("gemma3", None)
    types = runner.model.config.get_text_config().layer_types
    full = frozenset(i for i, t in enumerate(types) if t == "full_attention")
    window = runner.model.config.get_text_config().sliding_window
    tasks = {c["id"]: c for c in json.loads((HERE / "data" / "ruler_tasks.json").read_text())["contexts"]}
    prompts = json.loads((HERE / ".ruler-cache" / "gemma3.json").read_text())["contexts"]
    chosen = set(filter(None, args.contexts.split(","))) or {p["id"] for p in prompts if p["id"].startswith("1024/")}
    out: dict[str, dict] = {}
    for keep in args.keep_full:
        rows = []
        for p in (p for p in prompts if p["id"] in chosen):
            ids = torch.tensor([p["context_ids"]])
            T, sliding = ids.shape[1], len(types) - len(full)
            budget = args.share * (len(full) * T + sliding * (window - 1))
            # at least 20 slots per sliding layer (the question's own window reads them)
            kept_sliding = max(budget - keep * len(full) * T, 20.0 * sliding) / (sliding * (window - 1))
            policy = split_policy(full, round(1 - keep, 4), round(1 - kept_sliding, 4))
            base = runner_session(runner, ids)
            whole = kv_bytes(base.state)
            for i, q in enumerate(p["questions"]):
                session = base.fork()
                session.compress(policy, query_ids=torch.tensor([q["ids"]]))
                answer = runner.answer(session, ids, q)
                reference = tasks[p["id"]]["questions"][i]
                rows.append({"id": f"{p['id']}#{i}", "task": reference["task"], "answer": answer,
                             "score": string_match_all(answer, reference["outputs"]),
                             "bytes_held": kv_bytes(session.state) / whole, "kept_sliding": kept_sliding})
            print(keep, p["id"], [r["score"] for r in rows[-len(p["questions"]):]], flush=True)
        out[f"{keep:g}"] = {"accuracy": sum(r["score"] for r in rows) / len(rows),
                            "bytes_held": sum(r["bytes_held"] for r in rows) / len(rows), "questions": rows}
        print(f"keep_full {keep:g}: accuracy {out[f'{keep:g}']['accuracy']:.4f}", flush=True)
    write_results(args.name, {"model": "gemma3-270m (fp32)", "policy": "SnapKV(kernel=21, window=16)",
                                        "share": args.share, "full_layers": sorted(full), "runs": out})


def runner_session(runner: Runner, ids: torch.Tensor) -> object:
    from kvstate import Session

    base = Session(runner.model)
    base.extend(ids)
    return base


if __name__ == "__main__":
    main()
