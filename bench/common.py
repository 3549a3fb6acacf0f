"""Shared helpers of the benchmark scripts (run them as ``python bench/<name>.py``).

Every results file starts with ``environment()`` (key ``env``): the commit the numbers came from,
whether tracked files other than results had uncommitted changes, the library versions
and the cores, so a number in the README can always be traced to the code that produced it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn``, in seconds."""
    return statistics.median(times(fn, repeats))


def times(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn(setup())`` (or ``fn()``), setup excluded, in seconds."""
    out = []
    for _ in range(repeats):
        arg = setup() if setup is not None else None
        start = time.perf_counter()
        fn(arg) if setup is not None else fn()  # type: ignore[call-arg]
        out.append(time.perf_counter() - start)
    return out


def interleaved(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each of ``fns``, run in turn within each of ``rounds`` rounds.

    Every contender sees the same machine state (page cache, what malloc has kept from freed
    memory, the other processes): timed in separate blocks, one-off effects such as whether a
    large allocation arrives already mapped moved a millisecond ratio by up to 3x here. The order
    within a round is shuffled (seeded), because running right after a contender that freed a
    large buffer costs differently from running after one that did not.
    """
    for fn in fns.values():
        fn()  # warm every path first
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order, rng = list(fns.items()), random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name, fn in order:
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> str:
    """HEAD's commit; where the tree has no git (a device run copies it without .git), ``KVSTATE_COMMIT``, which
    the device run's caller sets (``scripts/device_run.py``)."""
    return _git("rev-parse", "HEAD") or os.environ.get("KVSTATE_COMMIT", "unknown")


def dirty() -> bool:
    """Uncommitted changes to tracked files other than results (which a run rewrites); False without git."""
    return bool(_git("status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)bench/results"))


def environment() -> dict[str, object]:
    """Commit, library versions, cores and threads of this run."""
    import torch
    import transformers

    import kvstate

    return {
        "commit": commit(),
        "dirty": dirty(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "kvstate": kvstate.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
    }


def write_results(name: str, result: dict[str, object]) -> Path:
    """``bench/results/<name>.json`` with the environment first; prints it too."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    text = json.dumps({"env": environment(), **result}, indent=2) + "\n"
    path.write_text(text)
    print(text)
    return path
