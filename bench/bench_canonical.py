"""What the canonical schedule costs: warm TTFT of a new turn, and cold prefill, by chunk size.

On the default Gemma-3-270M, in float32 and bfloat16 on this CPU. A history of H tokens
(prose from CPython's ``pydoc_data.topics``, PSF-2.0) is prefilled once per setting; then
a new turn of n tokens is timed, each repeat from a fork of that prefilled session
(``Session.generate(history + turn, max_new_tokens=1)``: time to the first token):

* ``off`` (``canonical_chunk=0``): the state is continued where it ends and only the n
  new tokens are fed, in one forward. This is the one-forward limit: the least any
  resume can feed. It is exact only to float32 rounding, not bitwise;
* ``C=16/32/64``: the canonical schedule: the resume restarts from the last multiple of
  C the state holds and feeds ``H mod C + n`` tokens in aligned chunks, so the answer
  is bitwise the cold one.

* ``C=64/128/256+marks``: the schedule with the chat template's turn marks (``kvstate.text.turn_marks``, "User:"
  for the default model's template): the turn starts with them, so the history's end is a cut and the
  resume feeds only the turn, as ``off`` does. A chat reaches that state with ``Session.settle(through=
  ...)`` after each answer (the server does it after replying). Timed against ``off`` on the same ids
  (the marks plus n tokens), as the ``marked`` rows.

The cold cost is the prefill of H tokens in chunks of C against chunks of 512 (``off``).
Contenders of one cell are interleaved within each round (``common.interleaved``).

    python bench/bench_canonical.py [--histories 1000 4000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from common import interleaved, write_results
from kvstate import Session
from kvstate.serve.chat import FALLBACK_TEMPLATE
from kvstate.testing import load_default_model
from kvstate.text import turn_marks

CHUNKS = (0, 16, 32, 64)
MARKED_CHUNKS = (64, 128, 256)  # C with turn marks: a turn of up to C tokens (marks included) is one forward
TURNS = (1, 8, 64)


def prose(tokenizer, n: int) -> torch.Tensor:
    """``[1, n]`` token ids of English prose (CPython's reference documentation)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(t for t in topics.values() if t.strip())
    return tokenizer(text[: 12 * n], return_tensors="pt").input_ids[:, :n]


def cell(model, ids: torch.Tensor, marks: tuple[int, ...], history: int, rounds: int) -> dict[str, object]:
    """Cold prefill and warm TTFT of each new turn, for every chunk size, and with turn marks."""
    sessions, cold = {}, {}
    for chunk in CHUNKS:
        s = Session(model, canonical_chunk=chunk)
        begin = time.perf_counter()
        s.extend(ids[:, :history])
        cold[chunk] = time.perf_counter() - begin
        sessions[chunk] = s
    for chunk in MARKED_CHUNKS:
        s = Session(model, canonical_chunk=chunk, canonical_marks=marks)
        begin = time.perf_counter()
        s.extend(ids[:, :history])
        cold[f"C={chunk}+marks"] = time.perf_counter() - begin
        sessions[f"C={chunk}+marks"] = s
    turns, marked = {}, {}
    for n in TURNS:
        full = ids[:, :history + n]
        turn = torch.cat([ids[:, :history], torch.tensor([marks]), ids[:, history:history + n]], 1)

        def ttft(s: Session, full: torch.Tensor) -> None:
            out = s.fork()
            out.generate(full, max_new_tokens=1, do_sample=False)
            return out.last_plan.fed

        timed = interleaved({f"C={c}" if c else "off": functools.partial(ttft, sessions[c], full) for c in CHUNKS},
                            rounds)
        turns[str(n)] = ratios(timed)
        both = {"off": functools.partial(ttft, sessions[0], turn),
                **{f"C={c}+marks": functools.partial(ttft, sessions[f"C={c}+marks"], turn) for c in MARKED_CHUNKS}}
        marked[str(n)] = {**ratios(interleaved(both, rounds)), "fed": {k: fn() for k, fn in both.items()}}
    return {"cold_prefill_seconds": {(f"C={c}" if c else "off (chunks of 512)") if isinstance(c, int) else c: v
                                     for c, v in cold.items()},
            "new_turn_ttft": turns, "marked_turn_ttft": marked}


def ratios(timed: dict[str, float]) -> dict[str, object]:
    off = timed["off"]
    return {"seconds": timed, "overhead_vs_one_forward": {k: v / off - 1 for k, v in timed.items()},
            "share_of_one_forward_limit": {k: off / v for k, v in timed.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 1k and 4k, not multiples of any chunk: a resume then re-feeds the tail since the last cut, as usually
    parser.add_argument("--histories", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    results: dict[str, object] = {}
    for dtype in args.dtypes:
        model, tokenizer = load_default_model(dtype=getattr(torch, dtype), progress=False)
        ids = prose(tokenizer, max(args.histories) + max(TURNS))
        marks = turn_marks(tokenizer, FALLBACK_TEMPLATE)
        for history in args.histories:
            print(f"{dtype}, history {history}", flush=True)
            results[f"{dtype}/{history}"] = cell(model, ids, marks, history, args.rounds)
            print(summary(results[f"{dtype}/{history}"]), flush=True)
    write_results("canonical", {"model": "default (Gemma-3-270M)", "turns": TURNS, "chunks": CHUNKS,
                                "marked_chunks": MARKED_CHUNKS,
                                "marks": [tokenizer.decode([t]) for t in marks], "results": results})


def summary(result: dict[str, object]) -> str:
    """Each turn's share of the one-forward limit, position cuts and with turn marks."""
    lines = []
    for n in TURNS:
        plain = result["new_turn_ttft"][str(n)]["share_of_one_forward_limit"]
        marked = result["marked_turn_ttft"][str(n)]["share_of_one_forward_limit"]
        shares = ", ".join(f"{k} {v:.0%}" for k, v in {**plain, **marked}.items() if k != "off")
        lines.append(f"  turn of {n}: {shares} of the one-forward limit")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
