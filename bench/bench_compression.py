"""Compression quality on natural text: real Gemma-3-270M, CPU, fp32.

Corpus: the prose of Python's own reference documentation, as shipped in every
CPython install (``pydoc_data.topics``, PSF License 2.0): paragraphs of English
prose, code blocks dropped, drawn in a seeded order. Nothing is repeated to fill.

* **Needle retrieval**: a 5-digit pass key sentence inserted at a depth of 10%, 50%
  or 90% of a 1k- or 2k-token haystack. The context is processed, compressed, then
  the question is appended and answered greedily (8 tokens). Question-agnostic
  columns compress before the question exists, as kvpress's pipeline does;
  question-aware columns score with the question (``compress(policy, query_ids=...)``).
* **Fidelity**: on haystacks without a needle, greedy agreement over 32 tokens and the
  mean KL(uncompressed || compressed) of the next-token distributions along the
  uncompressed greedy continuation (teacher-forced).
* **Memory**: state bytes against the uncompressed state.

Writes ``bench/results/compression.json`` and ``compression.png``. Run:
``python bench/bench_compression.py`` (needs the ``bench`` extra; about an hour on 2 idle cores);
``--only KVzip ExpectedAttention --no-fidelity --out NAME`` runs a subset of the needle columns.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common import RESULTS, write_results
from kvstate import Session
from kvstate.compress import (
    TOVA,
    ChunkKV,
    ExpectedAttention,
    KNorm,
    KVzip,
    Policy,
    Random,
    SnapKV,
    StreamingLLM,
    kvzip_prompt,
)
from kvstate.testing import load_default_model

LENGTHS = (1024, 2048)
DEPTHS = (0.1, 0.5, 0.9)
BUDGETS = (0.5, 0.25)
INTRO = "Read the following documentation carefully. Somewhere in it there is a pass key to remember.\n\n"
QUESTION = "\n\nWhat is the pass key mentioned in the text above? The pass key is"


def agnostic(tokenizer) -> dict[str, Callable[[float], Policy]]:
    """The question-agnostic columns: KVzip and ExpectedAttention as their names give them (per KV head, one
    ranking across layers and heads, the re-read inside the chat template, every prefill query), and as
    kvstate scored them before (``(earlier)``: one slot set per layer, a raw-text re-read, a 48-query fit)."""
    prompt = kvzip_prompt(tokenizer)
    return {
        "StreamingLLM": lambda r: StreamingLLM(r, sinks=4),
        "KNorm": lambda r: KNorm(r),
        "Random": lambda r: Random(r, seed=0),
        "TOVA": lambda r: TOVA(r),
        "SnapKV": lambda r: SnapKV(r, window=16, kernel=5),
        "ExpectedAttention": lambda r: ExpectedAttention(r),
        "KVzip": lambda r: KVzip(r),
        "KVzip(ranked)": lambda r: KVzip(r, sliding="ranked"),
        "ChunkKV(KVzip)": lambda r: ChunkKV(policy=KVzip(r), chunk=10),
        "ExpectedAttention(earlier)": lambda r: ExpectedAttention(r, window=48, epsilon=0.0, heads=False,
                                                                  scope="layer"),
        "KVzip(earlier)": lambda r: KVzip(r, prompt=prompt, softmax="model", heads=False, scope="layer"),
    }


AWARE: dict[str, Callable[[float], Policy]] = {
    "SnapKV": lambda r: SnapKV(r, window=16, kernel=5),
    # pooling over 9 slots keeps whole digit spans; chosen on a separate calibration set (seed 7, 12 cases)
    "SnapKV(k=9)": lambda r: SnapKV(r, window=16, kernel=9),
    "TOVA": lambda r: TOVA(r),
    "ExpectedAttention": lambda r: ExpectedAttention(r, window=48, heads=False, scope="layer"),
    "KVzip": lambda r: KVzip(r, heads=False, scope="layer"),
}
# the kvpress meaning of the ratio (sliding layers count the whole context), for like-for-like comparison
CONTEXT_SEMANTICS = ("KVzip(earlier)", "ExpectedAttention(earlier)", "KNorm")


def paragraphs() -> list[str]:
    """Prose paragraphs of the CPython reference documentation (``pydoc_data.topics``)."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            lines = block.split("\n")
            if any(line.startswith("     ") or ">>>" in line for line in lines):
                continue  # code, tables and examples: not prose
            text = " ".join(line.strip() for line in lines).strip()
            if len(text) > 200 and text.count("(") < 6 and not text.startswith(("*", "+", "|", "=")):
                out.append(text)
    return out


def haystack(tokenizer, corpus: list[str], tokens: int, rng: random.Random) -> list[str]:
    """Consecutive-ish paragraphs from a random place until ``tokens`` tokens."""
    start, out, n = rng.randrange(len(corpus)), [], 0
    while n < tokens:
        text = corpus[(start + len(out)) % len(corpus)]
        out.append(text)
        n += len(tokenizer(text, add_special_tokens=False).input_ids) + 2
    return out


def needle_cases(tokenizer, corpus: list[str], per_cell: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for length in LENGTHS:
        for depth in DEPTHS:
            for _ in range(per_cell):
                key = str(rng.randint(10000, 99999))
                paras = haystack(tokenizer, corpus, length - 40, rng)
                cut = round(depth * len(paras))
                before = tokenizer(INTRO + "\n\n".join(paras[:cut]) + "\n\n", return_tensors="pt").input_ids
                needle = tokenizer(f"The pass key is {key}. Remember it: the pass key is {key}.\n\n",
                                   add_special_tokens=False, return_tensors="pt").input_ids
                after = tokenizer("\n\n".join(paras[cut:]), add_special_tokens=False, return_tensors="pt").input_ids
                question = tokenizer(QUESTION, add_special_tokens=False, return_tensors="pt").input_ids
                cases.append({"length": length, "depth": depth, "key": key, "question": question,
                              "context": torch.cat([before, needle, after], 1),
                              "needle": (before.shape[1], before.shape[1] + needle.shape[1])})
    return cases


def answer(session: Session, context: torch.Tensor, question: torch.Tensor, tokenizer) -> str:
    out = session.generate(torch.cat([context, question], 1), max_new_tokens=8, do_sample=False)
    return tokenizer.decode(out[0])


def run_needles(model, tokenizer, cases: list[dict], only: tuple[str, ...] = (),
                budgets: tuple[float, ...] = BUDGETS) -> dict:
    rows: list[dict] = []
    policies = agnostic(tokenizer)
    for i, case in enumerate(cases):
        began = time.perf_counter()
        base = Session(model)
        base.extend(case["context"])
        hit = {"uncompressed": case["key"] in answer(base.fork(), case["context"], case["question"], tokenizer)}
        kept: dict[str, dict[int, float]] = {"attention to the needle": needle_attention(base, case)}
        held: dict[str, float] = {}
        runs = [(f"agnostic/{name}/{b}", make(1 - b), None, "window") for name, make in policies.items()
                for b in budgets]
        runs += [(f"aware/{name}/{b}", make(1 - b), case["question"], "window") for name, make in AWARE.items()
                 for b in budgets]
        runs += [(f"context/{name}/0.5", policies[name](0.5), None, "context") for name in CONTEXT_SEMANTICS]
        runs = [run for run in runs if not only or run[0].split("/", 2)[1] in only
                or "/".join(run[0].split("/", 2)[:2]) in only]
        for label, policy, query, sliding in runs:
            s = base.fork()
            report = s.compress(policy, query_ids=query, sliding=sliding)
            if label.endswith("/0.5"):
                kept[label] = needle_kept(s, case["needle"])
            held[label] = report.bytes_held
            hit[label] = case["key"] in answer(s, case["context"], case["question"], tokenizer)
        rows.append({"length": case["length"], "depth": case["depth"], "hits": hit, "needle_per_layer": kept,
                     "bytes_held": held})
        print(f"needle case {i + 1}/{len(cases)} ({case['length']} tokens, depth {case['depth']}): "
              f"{sum(hit.values())}/{len(hit)} hits, {time.perf_counter() - began:.0f} s", flush=True)
    return summarize(rows)


def needle_kept(session: Session, span: tuple[int, int]) -> dict[int, float]:
    """Per full-attention layer, the fraction of the needle's slots it still holds."""
    out = {}
    for i, layer in enumerate(session.state.layers):
        if getattr(layer, "window", 1) is None and layer.positions is not None:
            pos = layer.positions[0]  # [S], or [H, S] per head: then the heads' mean
            heads = pos.shape[0] if getattr(layer, "per_head", False) else 1
            out[i] = float(((pos >= span[0]) & (pos < span[1])).sum()) / (span[1] - span[0]) / heads
    return out


def needle_attention(session: Session, case: dict) -> dict[int, float]:
    """Per full-attention layer of the uncompressed state, the attention mass the question's last token
    pays to the needle (heads averaged): which layers retrieve it."""
    from kvstate.compress.observe import watch
    from kvstate.compress.policies import Needs

    state = session.state
    seen, _ = watch(session._engine, session.model, state, Needs(), case["question"])
    lo, hi = case["needle"]
    return {i: float(s.attention()[0, :, -1, lo:hi].sum(-1).mean()) for i, s in seen.items()
            if state.layers[i].window is None}


def summarize(rows: list[dict]) -> dict:
    labels = list(rows[0]["hits"])
    accuracy = {label: sum(r["hits"][label] for r in rows) / len(rows) for label in labels}
    base = accuracy["uncompressed"]
    kept = {label: (a / base if base else None) for label, a in accuracy.items()}
    by_cell = {f"{length}/{depth}": {label: sum(r["hits"][label] for r in rows
                                               if (r["length"], r["depth"]) == (length, depth))
                                     for label in labels}
               for length in LENGTHS for depth in DEPTHS}
    evidence = {}
    for label in rows[0]["needle_per_layer"]:
        layers = rows[0]["needle_per_layer"][label]
        evidence[label] = {str(i): sum(r["needle_per_layer"][label][i] for r in rows) / len(rows) for i in layers}
    held = {label: sum(r["bytes_held"][label] for r in rows) / len(rows) for label in rows[0]["bytes_held"]}
    return {"cases": len(rows), "accuracy": accuracy, "kept_of_uncompressed": kept, "bytes_held": held,
            "hits_by_cell": by_cell, "needle_per_full_layer": evidence, "rows": rows}


def run_fidelity(model, tokenizer, corpus: list[str], texts: int, seed: int) -> dict:
    rng = random.Random(seed + 1)
    policies = agnostic(tokenizer)
    totals: dict[str, dict[str, float]] = {}
    for t in range(texts):
        ids = tokenizer(INTRO + "\n\n".join(haystack(tokenizer, corpus, 1024, rng)), return_tensors="pt").input_ids
        base = Session(model)
        base.extend(ids)
        ref = base.fork().generate(ids, max_new_tokens=32, do_sample=False)
        ref_logits = teacher_forced(base.fork(), ref)
        full_bytes = base.state.nbytes
        for name, make in policies.items():
            for b in BUDGETS:
                # a policy ranked across layers has one meaning of the ratio; per-layer ones have two
                for sliding in ("window", "context") if make(0.5).ranking() is None else ("window",):
                    s = base.fork()
                    s.compress(make(1 - b), sliding=sliding)
                    got = teacher_forced(s.fork(), ref)
                    tokens = s.generate(ids, max_new_tokens=32, do_sample=False)
                    agree = common_prefix(tokens, ref) / ref.shape[1]
                    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref_logits.log_softmax(-1),
                                                    log_target=True, reduction="none").sum(-1).mean().item()
                    cell = totals.setdefault(f"{sliding}/{name}/{b}", {"kl": 0.0, "greedy_agreement": 0.0,
                                                                       "bytes_saved": 0.0})
                    cell["kl"] += kl / texts
                    cell["greedy_agreement"] += agree / texts
                    cell["bytes_saved"] += (1 - s.state.nbytes / full_bytes) / texts
        print(f"fidelity text {t + 1}/{texts} done", flush=True)
    return totals


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Tokens ``a`` ``[1, N]`` and ``b`` ``[1, M]`` agree on, from the start (greedy runs may stop early)."""
    n = min(a.shape[1], b.shape[1])
    return int((a[0, :n] == b[0, :n]).int().cumprod(0).sum())


def teacher_forced(session: Session, continuation: torch.Tensor) -> torch.Tensor:
    """Next-token logits ``[N, V]`` at each step, feeding the given continuation."""
    logits = [session.state.last_logits[0]]
    for token in continuation[0, :-1]:
        logits.append(session.extend(token.view(1, 1))[0])
    return torch.stack(logits).float()


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = result["needle"]["accuracy"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = sorted({label.split("/")[1] for label in acc if label.count("/") == 2})
    color = {name: f"C{i}" for i, name in enumerate(names)}  # one colour per policy in both panels
    for kind, style in (("agnostic", "o-"), ("aware", "s--")):
        for name in names:
            points = [(100.0, acc["uncompressed"])] + [(b * 100, acc[f"{kind}/{name}/{b}"]) for b in BUDGETS
                                                       if f"{kind}/{name}/{b}" in acc]
            if len(points) > 1:
                a.plot(*zip(*points, strict=True), style, color=color[name], label=f"{name} ({kind})")
    a.set(xlabel="KV budget (%)", ylabel="needle accuracy", title="Needle retrieval, Gemma-3-270M, natural text")
    fid = result["fidelity"]
    for name in names:
        points = [(100.0, 1.0)] + [(b * 100, fid[f"window/{name}/{b}"]["greedy_agreement"]) for b in BUDGETS
                                    if f"window/{name}/{b}" in fid]
        if len(points) > 1:
            b.plot(*zip(*points, strict=True), "o-", color=color[name], label=name)
    b.set(xlabel="KV budget (%)", ylabel="greedy agreement (share of 32 tokens)",
          title="Continuation fidelity (question-agnostic)")
    for ax in (a, b):
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    a.legend(fontsize=7, ncol=2)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from the results file")
    parser.add_argument("--per-cell", type=int, default=8, help="needle cases per (length, depth) cell")
    parser.add_argument("--texts", type=int, default=3, help="haystacks for the fidelity columns")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--only", nargs="*", default=(),
                        help="policy names (or kind/name, e.g. agnostic/KVzip) to run (default: all)")
    parser.add_argument("--budgets", type=float, nargs="*", default=BUDGETS, help="shares of the K/V kept")
    parser.add_argument("--no-fidelity", action="store_true", help="needle retrieval only")
    parser.add_argument("--out", default="compression", help="results name under bench/results")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads((RESULTS / f"{args.out}.json").read_text()), RESULTS / f"{args.out}.png")
        return
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    corpus = paragraphs()
    start = time.perf_counter()
    cases = needle_cases(tokenizer, corpus, args.per_cell, args.seed)
    result = {"model": "gemma3-270m (fp32, sdpa)", "corpus": {
        "source": "pydoc_data.topics (CPython reference documentation, PSF License 2.0), prose paragraphs only",
        "paragraphs": len(corpus)}, "lengths": list(LENGTHS), "depths": list(DEPTHS), "budgets": list(args.budgets),
        "needle": run_needles(model, tokenizer, cases, tuple(args.only), tuple(args.budgets))}
    write_results(args.out, result)  # the needle half survives a failure in the fidelity half
    if not args.no_fidelity:
        result["fidelity"] = run_fidelity(model, tokenizer, corpus, args.texts, args.seed)
    result["seconds"] = time.perf_counter() - start
    write_results(args.out, result)
    if not args.no_fidelity:
        plot(result, RESULTS / f"{args.out}.png")


if __name__ == "__main__":
    main()
