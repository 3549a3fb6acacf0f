"""The coverage sweep: every causal-LM type in the installed transformers, through kvstate.

For each ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``:

1. build a tiny random model with ``kvstate.models.shrink`` (a type that cannot be
   built is ``unbuilt``, with the reason);
2. let kvstate pick its adapter: registered, structural (after the self-check), or a
   typed refusal with its reason;
3. if accepted, check the contract against plain transformers: a split resume, a
   rollback to a divergent history, a fork, a reset, and save → load into a fresh
   instance **in another process**, each equal to plain ``model.generate``; and states
   saved under ``canonical_chunk`` 0 and 4, loaded into a fresh instance in the other
   process with ``Session.load``'s defaults, continue reusing the slots their own
   session reuses (the state's schedule travels with it).

A type is ``exact`` or ``exact-stepwise`` only if every check holds; an accepted type
that fails a check is ``WRONG`` (the goal is zero). Each type runs in worker processes
that are restarted when one crashes or hangs; the save → load check runs in the other
worker. Results go to a JSON file and to ``docs/coverage.md``.

Run: ``python scripts/coverage.py [--types a,b,c] [--json out.json] [--markdown docs/coverage.md]``
(after ``scripts/naive_shrink.py``, whose result it counts against).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r"""
import json, os, sys, warnings, logging, traceback
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
import torch
torch.set_num_threads(1)
from kvstate import Session
from kvstate.errors import KVStateError
from kvstate.selfcheck import adapter_for
from kvstate.models.shrink import tiny_causal_lm

def ids_for(model, n, seed):
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None) or model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(min(16, vocab // 2), vocab, (1, n), generator=gen)

def plain(model, ids, n):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, eos_token_id=None)
    return out[:, ids.shape[1]:]

def mine(session, ids, n):  # the mask plain gets: a random id equal to pad_token_id is a token in both
    return session.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, eos_token_id=None)

def phase1(t, folder):
    try:
        model = tiny_causal_lm(t)
    except Exception as exc:
        return {"status": "unbuilt", "reason": f"{type(exc).__name__}: {str(exc)[:200]}"}
    try:
        adapter = adapter_for(model)
    except KVStateError as exc:
        return {"status": "refused", "reason": str(exc)[:300]}
    status = "exact-stepwise" if adapter.caps.stepwise else "exact"
    ids, other = ids_for(model, 24, 1), ids_for(model, 5, 2)
    failed = []
    try:
        with torch.no_grad():
            s = Session(model)
            s.extend(ids[:, :16], torch.ones_like(ids[:, :16]))
            if not torch.equal(mine(s, ids, 4), plain(model, ids, 4)): failed.append("split resume")
            fork = s.fork()
            branch = torch.cat([ids[:, :20], other], 1)
            if not torch.equal(mine(s, branch, 4), plain(model, branch, 4)): failed.append("rollback")
            longer = torch.cat([ids, other], 1)
            if not torch.equal(mine(fork, longer, 3), plain(model, longer, 3)): failed.append("fork")
            fork.save(os.path.join(folder, t + ".kvs"))
            expected = plain(model, torch.cat([longer, ids[:, :3]], 1), 3)
            schedules = {}  # each state saved under canonical_chunk C, and what its own session reuses continuing it
            for chunk in (0, 4):
                saved = Session(model, canonical_chunk=chunk)
                saved.extend(ids[:, :18], torch.ones_like(ids[:, :18]))
                saved.save(os.path.join(folder, f"{t}.c{chunk}.kvs"))
                tokens = mine(saved.fork(), ids, 3)
                ones = torch.ones_like(ids)
                schedules[chunk] = {"reused": saved.fork().run(ids, ones, max_new_tokens=1).reused,
                                    "tokens": tokens.tolist()}
                if not torch.equal(tokens, plain(model, ids, 3)): failed.append(f"canonical_chunk={chunk}")
            s.reset()
            fresh = Session(model)
            if not torch.equal(mine(s, ids[:, :12], 3), mine(fresh, ids[:, :12], 3)): failed.append("reset")
    except Exception as exc:
        failed.append(f"crashed: {type(exc).__name__}: {str(exc)[:200]}")
        expected, schedules = None, {}
    config = model.config
    multimodal = any(getattr(config, k, None) is not None for k in ("vision_config", "audio_config", "encoder_config"))
    media = ("images, videos" if "pixel_values_videos" in adapter.caps.input_keys else
             "images" if "pixel_values" in adapter.caps.input_keys else
             "text only: media inputs refused (UnsupportedError)" if multimodal else "")
    return {"status": status if not failed else "WRONG", "adapter": adapter.caps.name, "media": media,
            "failed": failed,
            "expected": None if expected is None else expected.tolist(),
            "continue": None if expected is None else torch.cat([longer, ids[:, :3]], 1).tolist(),
            "schedules": schedules, "ids": ids.tolist()}

def phase2(t, folder, expected, history, schedules, ids):
    try:
        with torch.no_grad():
            model = tiny_causal_lm(t)
            loaded = Session.load(os.path.join(folder, t + ".kvs"), model)
            got = mine(loaded, torch.tensor(history), 3).tolist()
            if got != expected:
                return {"ok": False, "reason": "differs"}
            for chunk, want in schedules.items():  # a loaded state continues under the schedule it was fed with
                loaded = Session.load(os.path.join(folder, f"{t}.c{chunk}.kvs"), model)
                tokens = mine(loaded, torch.tensor(ids), 3).tolist()
                if tokens != want["tokens"] or loaded.last_plan.reused != want["reused"]:
                    return {"ok": False, "reason": f"canonical_chunk={chunk}: reused {loaded.last_plan.reused} "
                                                   f"of the {want['reused']} its own session reuses"}
        return {"ok": True}
    except Exception as exc:
        return {"ok": False, "reason": f"{type(exc).__name__}: {str(exc)[:200]}"}

for line in sys.stdin:
    job = json.loads(line)
    try:
        out = phase1(job["type"], job["folder"]) if job["phase"] == 1 else \
            phase2(job["type"], job["folder"], job["expected"], job["history"], job["schedules"], job["ids"])
    except BaseException as exc:
        out = {"status": "WRONG", "failed": [f"crashed: {type(exc).__name__}: {exc}"]}
    print(json.dumps(out), flush=True)
"""


class Worker:
    """A persistent worker process; restarted after a crash or a hang."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, bufsize=1, env=self.env)

    def run(self, job: dict, timeout: float = 240) -> dict | None:
        self.proc.stdin.write(json.dumps(job) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""  # type: ignore[union-attr]
        if line:
            return json.loads(line)
        self.proc.kill()
        self.proc.wait()
        self.proc = self._spawn()
        return None


def sweep(types: list[str]) -> dict[str, dict]:
    folder = tempfile.mkdtemp(prefix="kvstate-coverage-")
    env = {**os.environ, "KVSTATE_SELFCHECK_CACHE": os.path.join(folder, "selfcheck")}
    first, second = Worker(env), Worker(env)
    results = {}
    for t in types:
        start = time.perf_counter()
        r = first.run({"phase": 1, "type": t, "folder": folder}) or {"status": "WRONG", "failed": ["crashed"]}
        if r.get("status", "").startswith("exact") and r.get("expected") is not None:
            loaded = second.run({"phase": 2, "type": t, "folder": folder, "expected": r["expected"],
                                 "history": r["continue"], "schedules": r["schedules"], "ids": r["ids"]}) \
                or {"ok": False, "reason": "crashed"}
            if not loaded["ok"]:
                r["status"], r["failed"] = "WRONG", [*r["failed"], f"save → load: {loaded.get('reason', 'differs')}"]
        for key in ("expected", "continue", "schedules", "ids"):
            r.pop(key, None)
        r["seconds"] = round(time.perf_counter() - start, 1)
        results[t] = r
        print(f"{t:28} {r['status']:15} {r.get('reason') or ', '.join(r.get('failed', []))}"[:160], flush=True)
    return results


def _environment() -> dict[str, object]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from common import environment

    return environment()


def summary(results: dict[str, dict], naive: dict[str, str] | None) -> list[str]:
    """The coverage goal's numbers: pass rates over the built types and the naively buildable ones."""
    passed = {t for t, r in results.items() if r["status"].startswith("exact")}
    built = {t for t, r in results.items() if r["status"] != "unbuilt"}
    lines = [f"* {len(built)} of {len(results)} types build tiny; {len(passed & built)} of them pass "
             f"({100 * len(passed & built) / max(len(built), 1):.1f}%)."]
    if naive is not None:
        easy = {t for t, v in naive.items() if v == "ok"} & set(results)
        rest = sorted(easy - passed)
        lines.append(f"* {len(easy)} types build with a naive shrink (`scripts/naive_shrink.py`); "
                     f"{len(easy & passed)} of them pass" + (f"; refused: {', '.join(rest)}." if rest else "."))
    return lines


def markdown(results: dict[str, dict], env: dict[str, object], naive: dict[str, str] | None) -> str:
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines = [
        "# Coverage: every causal-LM type in transformers, through kvstate", "",
        f"Generated by `python scripts/coverage.py` with transformers {env['transformers']} and torch "
        f"{env['torch']} (kvstate commit {str(env['commit'])[:10]}), on tiny random models built by "
        "`kvstate.models.shrink`.", "",
        "* **exact**: kvstate resumes, rolls back, forks, resets, and saves → loads into a fresh instance in "
        "another process, each equal to plain `model.generate`;",
        "* **exact-stepwise**: the same, feeding continuations one token per forward (the model drops state on "
        "multi-token chunks);",
        "* **refused**: kvstate raises a typed error with the reason below (nothing is accepted on trust);",
        "* **unbuilt**: no tiny model could be built here (the reason below);",
        "* **WRONG**: accepted but a check failed. The goal is none.", "",
        "Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f" (of {len(results)}).", "",
        *summary(results, naive), "",
        "**media**: what a multimodal type's state holds. Qwen-VL carries images and videos, Gemma 3 images; "
        "other multimodal types run text-only, and kvstate refuses their media inputs with `UnsupportedError` "
        "before anything runs (their media state, such as paligemma's prefix-LM mask or mllama's "
        "cross-attention K/V, needs a family adapter).", "",
        "| model_type | status | adapter | media | reason |", "|---|---|---|---|---|",
    ]
    for t, r in sorted(results.items()):
        reason = r.get("reason") or ", ".join(r.get("failed", []))
        lines.append(f"| {t} | {r['status']} | {r.get('adapter', '')} | {r.get('media', '')} | "
                     f"{reason.replace('|', '/')[:160]} |")
    return "\n".join(lines) + "\n"


def image_text_section() -> str:
    """The image-text-to-text types (not causal-LM types, so not swept above) and what kvstate does
    with their media: carried by a family adapter, or refused before anything runs."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from kvstate.adapters.base import registered_type

    lines = ["", "## Image-text-to-text types", "",
             "These are not causal-LM types, so the sweep above does not build them. Their media state is what "
             "a family adapter carries; where none is registered, kvstate refuses media inputs before anything "
             "runs: `UnsupportedError` for the usual media keys (`kvstate.request.MEDIA_KEYS`), `InputError` for "
             "inputs it does not know. Their text path is not swept here.", "",
             "| model_type | media | tested in |", "|---|---|---|"]
    checked = {  # what the suite proves for types without a media adapter
        "llava": "refused; text path exact", "mllama": "refused; text path exact",
        "paligemma": "refused: the self-check refuses the model (its prefix-LM attention is not causal)"}
    for t in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        adapter = registered_type(t)
        keys = adapter.caps.input_keys if adapter is not None else ()
        media = "images, videos" if "pixel_values_videos" in keys else "images" if "pixel_values" in keys else \
            checked.get(t, "refused")
        tests = "tests/test_media_gemma3.py" if t == "gemma3" else "tests/test_media_video.py, tests/test_media.py" \
            if "pixel_values_videos" in keys else "tests/test_media_refused.py" if t in checked else ""
        lines.append(f"| {t} | {media} | {tests} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", help="comma-separated model types (default: all)")
    parser.add_argument("--json", type=Path, default=Path("bench/results/coverage.json"))
    parser.add_argument("--markdown", type=Path, default=Path("docs/coverage.md"))
    args = parser.parse_args()
    types = args.types.split(",") if args.types else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    results = sweep(types)
    env = _environment()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"env": env, "results": results}, indent=1) + "\n")
    naive_path = Path("bench/results/naive_shrink.json")
    naive = json.loads(naive_path.read_text())["results"] if naive_path.is_file() else None
    print("\n".join(summary(results, naive)))
    if not args.types:
        args.markdown.write_text(markdown(results, env, naive) + image_text_section())
    counts = {s: sum(r["status"] == s for r in results.values()) for s in {r["status"] for r in results.values()}}
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
