"""One lent GPU, one command: the exactness check and the speed benchmark, every step under a hard timeout.

The command, run from the repository root on the device (carry ``.whl`` if it holds wheels the image lacks, e.g.
platformdirs: ``pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl platformdirs``):

    KVSTATE_COMMIT=$(git rev-parse HEAD) python3 scripts/device_run.py --budget 330

and its CPU trial (the same steps at small shapes, the CUDA path stood in on the CPU: ``kvstate.testing``):

    python scripts/device_run.py --cpu-trial --budget 300 --out /tmp/device_run

Sizing: 15 minutes of device time hold the machine's start and two runs of ``--budget 330`` (a run and a rerun).
The steps run in the order of what matters most, so a run cut short has measured the rest of what it could:

1. the 8B shape (Qwen3-8B, random weights, built on the device) and its warm-path matrix at 4k tokens: next turn,
   fork, state file, prefix store, truncate, each against a cold run, with the slots it reused;
2. the tiny families (a video included: its vision attention against plain sdpa's), the same matrix;
3. the canonical schedule's costs at the device's chunk: cold prefill of 4k against plain ``generate``, a 16-token
   warm turn against plain ``generate`` continuing a ``DynamicCache``;
4. one stream against plain ``generate``; the bandwidth bound; 16 streams against transformers' ``generate_batch``;
5. the attention kernels probe; the matrix at 16k tokens; the costs of the other chunks.

A child process runs the steps; this parent watches it. A step past its timeout (or the budget) has its child
killed and the next step starts in a new child, which builds what it needs again under that step's timeout. Both
JSON files are written after every step (``device_check_cuda.json``: exactness and costs; ``gpu_speed.json``:
speed), each with the commit, versions, the device's identity and every step's status and seconds.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "scripts"), str(ROOT / "bench"), *glob.glob(str(ROOT / ".whl/*.whl"))]


@dataclass(frozen=True)
class Step:
    """One step: its name, the report it fills (``check`` or ``speed``) and its timeout in seconds."""

    name: str
    report: str
    timeout: float


def steps(args: argparse.Namespace) -> list[Step]:
    """The steps of this run, most important first (module docstring)."""
    first, *rest = args.lengths
    out = [Step("build", "check", 90), Step(f"big {first}", "check", 150), Step("tiny", "check", 60),
           Step(f"costs C={args.chunk}", "check", 60), Step("one stream", "speed", 60),
           Step("bandwidth", "speed", 20)]
    out += [Step(f"streams {n}", "speed", 60 + 4 * n) for n in args.streams]
    out += [Step("kernels", "check", 40)]
    out += [Step(f"big {n}", "check", 240) for n in rest]
    out += [Step(f"costs C={c}", "check", 60) for c in args.chunks if c != args.chunk]
    scale = args.timeout_scale
    return [Step(s.name, s.report, s.timeout * scale) for s in out
            if args.only in (None, s.report) and s.name not in args.skip]


# ----- the parent: runs children, enforces the timeouts, writes the reports ------------------------------------------
def parent(args: argparse.Namespace) -> int:
    began = time.monotonic()
    plan = steps(args)
    reports = {"check": new_report(args, "check"), "speed": new_report(args, "speed")}
    events = args.out / "device_run.events.jsonl"
    index = 0
    while index < len(plan):
        left = args.budget - (time.monotonic() - began)
        if left < 5:
            for step in plan[index:]:
                record(reports, step, {"status": "skipped: budget spent"})
            break
        index = supervise(args, plan, index, events, reports, began)
        write(args, reports, began)
    write(args, reports, began)
    check = reports["check"]["summary"]
    print(json.dumps({"check": check, "speed": reports["speed"]["summary"]}, indent=2))
    return 0 if check.get("bitwise_all") is not False and all_done(reports) else 1


def supervise(args: argparse.Namespace, plan: list[Step], index: int, events: Path, reports: dict,
              began: float) -> int:
    """Run one child from step ``index`` until it ends or a step overruns; the index of the next step to run."""
    events.write_text("")
    child = subprocess.Popen([sys.executable, __file__, "--child", str(index), *args.argv], start_new_session=True)
    seen, current, after, since = 0, None, index, time.monotonic()  # after: the step the child runs next
    try:
        while True:
            exited = child.poll() is not None  # before reading: every event of an exited child is in the file
            text = events.read_text()
            complete = text[:text.rfind("\n") + 1].splitlines()  # a line being written waits for the next look
            for line in complete[seen:]:
                event = json.loads(line)
                if event["event"] == "start":
                    current, since = event["index"], time.monotonic()
                    print(f"[{since - began:6.1f} s] {plan[current].name}", flush=True)
                else:
                    record(reports, plan[event["index"]], event)
                    current, after, since = None, event["index"] + 1, time.monotonic()
                    write(args, reports, began)
            seen = len(complete)
            if exited:
                if after < len(plan):  # it died in a step, or before one began
                    record(reports, plan[after], {"status": f"crashed: exit {child.returncode}",
                                                  "seconds": round(time.monotonic() - since, 1)})
                    return after + 1
                return after
            # a step has its timeout; a child starting (imports) or between steps gets a minute; none past the budget
            limit = min(plan[current].timeout if current is not None else 60, args.budget - (since - began))
            if time.monotonic() - since > limit:
                record(reports, plan[after if current is None else current],
                       {"status": f"timeout after {limit:.0f} s", "seconds": round(limit, 1)})
                return (after if current is None else current) + 1
            time.sleep(0.2)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def new_report(args: argparse.Namespace, kind: str) -> dict:
    import torch
    import transformers

    import kvstate
    from common import commit, dirty

    report = {"commit": commit(), "dirty": dirty(), "kvstate": kvstate.__version__, "torch": torch.__version__,
              "transformers": transformers.__version__, "device": args.device, "device_name": device_name(args),
              "dtype": args.dtype, "shape": args.shape, "cpu_trial": args.cpu_trial, "steps": []}
    keys = ("big", "tiny", "costs", "kernels") if kind == "check" else ("one_stream", "streams", "bandwidth_bytes_s")
    return report | {k: [] for k in keys}


def record(reports: dict, step: Step, event: dict) -> None:
    report = reports[step.report]
    report["steps"].append({"name": step.name, "status": event.get("status", "done"),
                            "seconds": event.get("seconds")})
    for key, value in (event.get("result") or {}).items():
        report[key].extend(value if isinstance(value, list) else [value])


def write(args: argparse.Namespace, reports: dict, began: float) -> None:
    import device_check

    from bench_gpu import plot
    from bench_gpu import summary as speed_summary

    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "_cpu_trial" if args.cpu_trial else ""
    for kind, name in (("check", "device_check_cuda"), ("speed", "gpu_speed")):
        report = reports[kind]
        report["seconds"] = round(time.monotonic() - began, 1)
        report["incomplete"] = [s["name"] for s in report["steps"] if s["status"] != "done"] or None
        report["summary"] = (device_check.summary(report, args.chunk) if kind == "check"
                             else speed_summary(report, args.chunk))
        path = args.out / f"{name}{suffix}.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        if kind == "speed" and report["streams"]:
            plot(report, path.with_suffix(".png"))


def all_done(reports: dict) -> bool:
    return all(s["status"] == "done" for r in reports.values() for s in r["steps"])


def device_name(args: argparse.Namespace) -> str:
    if args.cpu_trial:
        from kvstate.testing.cuda_stand_in import GPU

        return f"cpu (CUDA path stood in as {GPU})"
    import torch

    from kvstate._compat.attention import _cuda_identity

    return _cuda_identity(torch.cuda.current_device()) if args.device == "cuda" else args.device


# ----- the child: runs the steps in order, one event line each -------------------------------------------------------
def child(args: argparse.Namespace, first: int) -> int:
    import contextlib

    import torch

    torch.set_num_threads(args.threads) if args.threads else None
    plan = steps(args)
    events = args.out / "device_run.events.jsonl"
    context = Context(args)
    stand_in = contextlib.nullcontext()
    if args.cpu_trial:
        from kvstate.testing.cuda_stand_in import cuda_stand_in

        stand_in = cuda_stand_in()
    with stand_in:
        for index in range(first, len(plan)):
            emit(events, {"index": index, "event": "start"})
            begin = time.monotonic()
            try:
                result, status = context.run(plan[index]), "done"
            except Exception:
                result, status = None, "error: " + traceback.format_exc()[-1500:]
            emit(events, {"index": index, "event": "end", "status": status, "result": result,
                          "seconds": round(time.monotonic() - begin, 1)})
    return 0


def emit(events: Path, event: dict) -> None:
    with events.open("a") as f:
        f.write(json.dumps(event) + "\n")


class Context:
    """What the steps of one child share: the built big model (built again by a new child)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.model = args, None

    def big(self):
        import device_check
        import torch

        if self.model is None:
            longest = max([*self.args.lengths, self.args.cost_length + 64])
            self.model = device_check.big(self.args.shape, self.args.device, getattr(torch, self.args.dtype), longest)
        return self.model

    def run(self, step: Step) -> dict:
        import device_check

        import bench_gpu

        a = self.args
        if step.name == a.stall:
            time.sleep(1e6)
        kind, _, value = step.name.partition(" ")
        if kind == "build":
            self.big()
            return {}
        if kind == "big":
            return {"big": device_check.big_row(self.big(), a.shape, int(value), a.chunk, a.device)}
        if kind == "tiny":
            return {"tiny": [device_check.tiny_row(spec, a.device, a.tiny_dtype or a.dtype) for spec in a.tiny]}
        if kind == "costs":
            return {"costs": device_check.costs(self.big(), a.cost_length, int(value[2:]), a.device)}
        if kind == "kernels":
            return {"kernels": device_check.kernels_row(a, max(a.lengths))}
        if step.name == "one stream":
            return {"one_stream": bench_gpu.one_stream(self.big(), a.device)}
        if kind == "bandwidth":
            return {"bandwidth_bytes_s": bench_gpu.bandwidth(a.device)}
        if kind == "streams":
            return {"streams": bench_gpu.streams(self.big(), int(value), a.device, a.longest_prompt)}
        raise ValueError(f"unknown step {step.name!r}")


# ----- arguments -----------------------------------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run (default 330)")
    parser.add_argument("--cpu-trial", action="store_true", help="small shapes on the CPU, the CUDA path stood in")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "results"),
                        help="folder of the JSON files (default $OUT, else bench/results)")
    parser.add_argument("--only", choices=["check", "speed"], help="run only the exactness or the speed steps")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tiny-dtype", choices=["float32", "bfloat16", "float16"], help="default: --dtype")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the child (0: torch's default)")
    parser.add_argument("--skip", nargs="*", default=[], metavar="STEP", help="steps not to run, by name")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every step's timeout")
    parser.add_argument("--stall", metavar="STEP", help="a planted fault: this step never ends (checks the watchdog)")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = [a for i, a in enumerate(argv) if a != "--child" and (i == 0 or argv[i - 1] != "--child")]
    trial = args.cpu_trial
    args.device = "cpu" if trial else "cuda"
    args.shape = "small" if trial else "8b"
    args.lengths = [96, 160] if trial else [4096, 16384]
    args.chunks = [16, 32] if trial else [512, 256, 1024]
    args.chunk = 32 if trial else 512  # the device's canonical chunk (the CUDA path's, stood in on the CPU trial)
    args.cost_length = 100 if trial else 4000
    args.streams = [4] if trial else [16, 8]
    args.longest_prompt = 128 if trial else 460  # the streams' prompts: 64 tokens up to this
    args.tiny = ["tiny:llama", "tiny:qwen3_vl"] if trial else ["tiny:llama", "tiny:gemma3_text", "tiny:qwen3_vl",
                                                                  "tiny:lfm2"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return child(args, args.child) if args.child is not None else parent(args)


if __name__ == "__main__":
    sys.exit(main())
