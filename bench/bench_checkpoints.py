"""Checkpoint benchmark: a tiny Qwen3-Next hybrid (linear attention + full attention), 4k tokens.

A conversation of 4,096 tokens is processed with a checkpoint every 512 tokens.
Then a request arrives whose history diverges after 3,900 tokens. Measured side by
side: resuming from the latest checkpoint at or before the divergence vs re-feeding
the whole history from scratch (what a cache without checkpoints must do, since
recurrent state cannot be cropped), and the memory the checkpoints cost.
Writes ``bench/results/checkpoints.json``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import write_results
from kvstate import Session
from kvstate.testing.tiny import CONFIGS, tiny_model, tiny_prompt


def run(model, history, diverged, every: int, keep: int) -> tuple[float, Session]:
    session = Session(model, checkpoint_every=every, max_checkpoints=keep, chunk_size=every)
    session.extend(history)
    start = time.perf_counter()
    session.generate(diverged, max_new_tokens=1, do_sample=False)
    return time.perf_counter() - start, session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="qwen3_next", choices=["qwen3_next", "lfm2"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--diverge-at", type=int, default=3900)
    parser.add_argument("--every", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    CONFIGS[args.arch]["max_position_embeddings"] = 2 * args.tokens
    model = tiny_model(args.arch)
    history = tiny_prompt(args.tokens)
    diverged = torch.cat([history[:, :args.diverge_at], tiny_prompt(16, seed=9)], 1)
    with_cp, without = [], []
    for _ in range(args.repeats):
        t, s_cp = run(model, history, diverged, args.every, 16)
        with_cp.append(t)
        t, s_none = run(model, history, diverged, args.every, 0)
        without.append(t)
    summary = s_cp.state.summary()
    result = {
        "model": f"tiny {args.arch} ({[layer.kind for layer in s_cp.state.layers]})", "tokens": args.tokens,
        "diverge_at": args.diverge_at, "checkpoint_every": args.every,
        "resumed_from": s_cp.last_plan.reused, "plan_with": s_cp.last_plan.mode, "plan_without": s_none.last_plan.mode,
        "with_checkpoints_s": statistics.median(with_cp), "from_scratch_s": statistics.median(without),
        "speedup": statistics.median(without) / statistics.median(with_cp),
        "checkpoints": summary["checkpoints"], "checkpoint_bytes": summary["checkpoint_nbytes"],
        "state_bytes": summary["nbytes"],
        "checkpoint_bytes_per_checkpoint": summary["checkpoint_nbytes"] / max(len(summary["checkpoints"]), 1),
    }
    write_results("checkpoints", result)


if __name__ == "__main__":
    main()
