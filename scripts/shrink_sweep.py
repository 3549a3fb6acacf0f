"""Build-check every causal-LM ``model_type`` with ``kvstate.models.shrink.tiny_causal_lm``.

Usage::

    python scripts/shrink_sweep.py OUT.json [--jobs N] [--timeout S] [--notes NOTES.json] [TYPE ...]

Each type runs in a worker subprocess (``--worker`` mode, one type per stdin line, one JSON line back); a worker
that crashes or hangs past the timeout is killed and replaced. ``OUT.json`` gets ``{type: "ok" | "error: ..."}``.

The check: build the tiny model, forward 8 tokens with ``use_cache=True``, then greedy ``generate`` of 3 tokens with
an attention mask. For recurrent/hybrid types whose ``generate`` fails inside transformers with "`get_seq_length` can
only be called on Attention layers", a forward of 1 token continuing the cache counts instead (noted
``step-only``). Notes (not failures) also record: ``no-cache`` (the forward returns no cache), ``cache-mismatch``
(the cached 1-token step differs from the full recomputation), ``bidirectional`` (earlier logits depend on later
tokens), ``step-error`` / ``extra-check-error`` (those extra checks failed), parameter count and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from typing import Any

TIMEOUT_S = 120


def _check(model_type: str) -> tuple[str, list[str]]:
    """Run the build check for one type; return ``("ok" | "error: ...", notes)``."""
    import torch

    from kvstate.models.shrink import tiny_causal_lm

    notes: list[str] = []
    model = tiny_causal_lm(model_type)
    notes.append(f"{sum(p.numel() for p in model.parameters()) / 1e3:.0f}k")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(100, vocab), (1, 9), generator=gen)
    with torch.no_grad():
        out = model(ids[:, :8], use_cache=True)
        cache_arg = _cache_argument(model)
        cache = next((getattr(out, k) for k in (cache_arg, "past_key_values", "cache")
                      if getattr(out, k, None) is not None), None)
        if cache is None:
            notes.append("no-cache")
        step = None
        try:
            model.generate(ids[:, :8], attention_mask=torch.ones_like(ids[:, :8]), max_new_tokens=3, do_sample=False)
        except ValueError as e:
            if "get_seq_length" not in str(e) or cache is None:
                raise
            notes.append("step-only")  # the 1-token continuation of the cache is the requirement instead
            step = model(ids[:, 8:], **{cache_arg: cache}, use_cache=True).logits.float()
        if step is None and cache is not None:
            try:
                step = model(ids[:, 8:], **{cache_arg: cache}, use_cache=True).logits.float()
            except Exception as e:
                notes.append(f"step-error({_brief(e)})")
        try:
            _compare(model, ids, step, notes)
        except Exception as e:
            notes.append(f"extra-check-error({_brief(e)})")
    return "ok", notes


def _brief(e: BaseException, n: int = 80) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:n]}"


def _cache_argument(model: Any) -> str:
    """The name under which this model's forward takes a cache (``past_key_values`` for most)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    names = ("past_key_values", "cache", "cache_params", "mems", "state", "past_buckets_states")
    return next((k for k in names if k in params), "past_key_values")


def _compare(model: Any, ids: Any, step: Any, notes: list[str]) -> None:
    """Note cache/causality oddities: a cached step that differs from recomputation, non-causal logits."""
    full = model(ids).logits.float()
    scale = full.abs().max().item() or 1.0
    if step is not None and (step[:, -1] - full[:, -1]).abs().max().item() > 1e-4 * scale:
        notes.append("cache-mismatch")
    changed = ids.clone()
    changed[0, -1] = 3 if ids[0, -1] != 3 else 4
    other = model(changed).logits.float()
    if (other[:, :-1] - full[:, :-1]).abs().max().item() > 1e-5 * scale:
        notes.append("bidirectional")


def worker() -> None:
    """Answer one JSON line per model type read from stdin."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    answers = os.fdopen(os.dup(1), "w")  # stdout is ours alone; whatever a model prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        model_type = line.strip()
        start = time.time()
        try:
            result, notes = _check(model_type)
        except BaseException as e:  # every failure is a result
            result, notes = f"error: {_brief(e, 300)}", []
        notes.append(f"{time.time() - start:.2f}s")
        print(json.dumps({"type": model_type, "result": result, "notes": notes}), file=answers, flush=True)


class _Slot:
    """One worker subprocess and the type it is working on."""

    def __init__(self) -> None:
        self.proc = self._spawn()
        self.model_type: str | None = None
        self.deadline = 0.0

    @staticmethod
    def _spawn() -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, __file__, "--worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1)

    def give(self, model_type: str, timeout: float) -> None:
        assert self.proc.stdin is not None
        self.model_type, self.deadline = model_type, time.time() + timeout
        self.proc.stdin.write(model_type + "\n")
        self.proc.stdin.flush()

    def restart(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc = self._spawn()
        self.model_type = None


def sweep(types: list[str], jobs: int, timeout: float) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Run the check for ``types`` on ``jobs`` workers; print one line per type as it finishes."""
    results: dict[str, str] = {}
    notes: dict[str, list[str]] = {}
    todo = list(reversed(types))
    slots = [_Slot() for _ in range(max(1, min(jobs, len(types))))]
    while todo or any(s.model_type for s in slots):
        for slot in slots:
            if slot.model_type is None and todo:
                slot.give(todo.pop(), timeout)
        busy = {s.proc.stdout: s for s in slots if s.model_type}
        wait = max(0.0, min(s.deadline for s in busy.values()) - time.time())
        ready, _, _ = select.select(list(busy), [], [], wait)
        for slot in busy.values():
            if slot.proc.stdout in ready:
                line = slot.proc.stdout.readline()
                answer = json.loads(line) if line else None
            elif time.time() > slot.deadline:
                answer = None
            else:
                continue
            model_type = slot.model_type
            assert model_type is not None
            if answer is None:
                results[model_type], notes[model_type] = "error: crashed or timed out", []
                slot.restart()
            else:
                results[model_type], notes[model_type] = answer["result"], answer["notes"]
                slot.model_type = None
            print(f"{model_type} {results[model_type][:160]} [{' '.join(notes[model_type])}]", flush=True)
    for slot in slots:
        assert slot.proc.stdin is not None
        slot.proc.stdin.close()
        slot.proc.wait()
    return dict(sorted(results.items())), dict(sorted(notes.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="where to write {type: 'ok' | 'error: ...'} as JSON")
    parser.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes in parallel")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per type before a restart")
    parser.add_argument("--notes", help="also write {type: [notes]} as JSON here")
    args = parser.parse_intermixed_args()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    results, notes = sweep(types, args.jobs, args.timeout)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if args.notes:
        with open(args.notes, "w") as f:
            json.dump(notes, f, indent=1)
    print(sum(v == "ok" for v in results.values()), "of", len(results), "build")


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main()
