"""Compression quality (issue 6) on the real Gemma-3-270M, CPU, fp32.

* Passkey retrieval: a 5-digit key hidden at random depths in ~1k tokens of filler
  (fixed seed). The context is processed, compressed, then the question is appended
  and answered greedily. Accuracy per policy at budgets 100% / 50% / 25% / 10%.
* Continuation fidelity on natural text: mean KL(uncompressed || compressed) of the
  next-token distributions along the uncompressed greedy continuation (teacher-forced),
  and greedy agreement over 32 tokens.
* Memory: state bytes per budget.

Writes ``bench/results/compression.json`` and ``bench/results/compression.png``.
Run: ``python bench/bench_compression.py [--cases 20]`` (needs the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from common import RESULTS, write_results
from kvstate import Session
from kvstate.compress import TOVA, KNorm, PerLayerBudget, Random, SnapKV, StreamingLLM
from kvstate.testing import load_default_model

BUDGETS = (1.0, 0.5, 0.25, 0.1)
POLICIES = {
    "StreamingLLM": lambda r: StreamingLLM(r, sinks=4),
    "SnapKV": lambda r: SnapKV(r, window=16, kernel=5),
    "TOVA": lambda r: TOVA(r),
    "KNorm": lambda r: KNorm(r),
    "Random": lambda r: Random(r, seed=0),
    "PyramidKV(SnapKV)": lambda r: PerLayerBudget(r, policy=SnapKV(window=16, kernel=5)),
}
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
STORY = ("The old harbour town woke slowly. Fishermen hauled their nets along the stone quay while gulls argued "
         "over scraps, and the baker on Church Street pulled the first loaves from an oven older than anyone "
         "could remember. By nine the market square was full: farmers with crates of apples, a man selling "
         "knives, children chasing a dog between the stalls. Mara, who kept the lighthouse, came down once a "
         "week for bread, lamp oil and news. This week the news was about the storm that had wrecked a cargo "
         "ship off the northern rocks, and about the strange crates that had washed up on the beach afterwards. ")


def passkey_cases(tokenizer, n: int, tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        key = str(rng.randint(10000, 99999))
        needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
        blocks = max(1, tokens // 24)
        depth = rng.randint(0, blocks - 1)
        text = FILLER * depth + needle + FILLER * (blocks - depth)
        context = tokenizer(text, return_tensors="pt").input_ids
        question = tokenizer(" What is the pass key? The pass key is", add_special_tokens=False,
                             return_tensors="pt").input_ids
        cases.append((context, question, key))
    return cases


def answer(session: Session, context: torch.Tensor, question: torch.Tensor, tokenizer) -> str:
    out = session.generate(torch.cat([context, question], 1), max_new_tokens=7, do_sample=False)
    return tokenizer.decode(out[0])


def run_passkey(model, tokenizer, args) -> dict[str, dict[str, float]]:
    cases = passkey_cases(tokenizer, args.cases, args.tokens, args.seed)
    hits = {name: {str(b): 0 for b in BUDGETS} for name in POLICIES}
    for i, (context, question, key) in enumerate(cases):
        base = Session(model)
        base.extend(context)
        for name, make in POLICIES.items():
            for budget in BUDGETS:
                s = base.fork()
                if budget < 1.0:
                    s.compress(make(1.0 - budget))
                hits[name][str(budget)] += key in answer(s, context, question, tokenizer)
        print(f"passkey case {i + 1}/{len(cases)} done", flush=True)
    return {name: {b: h / len(cases) for b, h in row.items()} for name, row in hits.items()}


def run_fidelity(model, tokenizer, args) -> dict[str, dict[str, dict[str, float]]]:
    ids = tokenizer(STORY * 8, return_tensors="pt").input_ids[:, : args.tokens]
    base = Session(model)
    base.extend(ids)
    ref = base.fork().generate(ids, max_new_tokens=32, do_sample=False)
    ref_logits = teacher_forced(base.fork(), ref)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, make in POLICIES.items():
        out[name] = {}
        for budget in BUDGETS[1:]:
            s = base.fork()
            s.compress(make(1.0 - budget))
            nbytes = s.state.nbytes
            got = teacher_forced(s.fork(), ref)
            tokens = s.generate(ids, max_new_tokens=32, do_sample=False)
            agree = int((tokens == ref)[0].int().cumprod(0).sum())
            kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref_logits.log_softmax(-1), log_target=True,
                                            reduction="none").sum(-1).mean().item()
            out[name][str(budget)] = {"kl": kl, "greedy_agree_of_32": agree, "state_bytes": nbytes}
    out["uncompressed"] = {"1.0": {"kl": 0.0, "greedy_agree_of_32": 32, "state_bytes": base.state.nbytes}}
    return out


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

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in POLICIES:
        a.plot([float(x) * 100 for x in result["passkey"][name]], list(result["passkey"][name].values()), "o-",
               label=name)
        fid = result["fidelity"][name]
        b.plot([100] + [float(x) * 100 for x in fid], [32] + [v["greedy_agree_of_32"] for v in fid.values()], "o-",
               label=name)
    a.set(xlabel="KV budget (%)", ylabel="passkey accuracy", title="Passkey retrieval, Gemma-3-270M")
    b.set(xlabel="KV budget (%)", ylabel="greedy agreement (of 32)", title="Continuation fidelity")
    for ax in (a, b):
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    start = time.perf_counter()
    result = {"model": "gemma3-270m (fp32, sdpa)", "context_tokens": args.tokens, "cases": args.cases,
              "budgets": list(BUDGETS), "passkey": run_passkey(model, tokenizer, args),
              "fidelity": run_fidelity(model, tokenizer, args)}
    result["seconds"] = time.perf_counter() - start
    write_results("compression", result)
    plot(result, RESULTS / "compression.png")


if __name__ == "__main__":
    main()
