"""The device run (``scripts/device_run.py``): what a lent GPU runs, tried here on the CPU so it cannot rot.

* its CPU trial (small shapes, the CUDA attention path stood in) passes: every step done, both JSON files written,
  every warm row bitwise *and* reusing slots (a warm row that reused nothing tested nothing), the video's vision
  tower within rounding of plain sdpa's;
* a step past its hard timeout is killed, recorded, and the next step runs in a new process;
* the summary's verdict refuses a warm row that reused nothing, whatever its bits (a rule written here).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import children

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
RUN = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def device_run(tmp_path: Path, *args: str) -> tuple[int, str]:
    done = children.run(RUN, str(SCRIPTS / "device_run.py"), "--cpu-trial", "--threads", "1", "--out",
                        str(tmp_path), *args, check=False, timeout=600)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow
def test_the_cpu_trial_of_the_device_run_passes_with_reuse_on_every_warm_row(tmp_path):
    code, output = device_run(tmp_path, "--budget", "400")
    assert code == 0, output
    check = json.loads((tmp_path / "device_check_cuda_cpu_trial.json").read_text())
    speed = json.loads((tmp_path / "gpu_speed_cpu_trial.json").read_text())
    names = [s["name"] for s in check["steps"]]
    assert names[:3] == ["build", "big 96", "tiny"]  # the bitwise rows with reuse come first
    assert all(s["status"] == "done" for s in check["steps"] + speed["steps"]) and check["incomplete"] is None
    assert check["commit"] and "stood in" in check["device_name"]
    rows = check["tiny"] + check["big"]
    assert {r["model"] for r in rows} == {"tiny:llama", "tiny:qwen3_vl", "small"}
    for row in rows:
        for name, path in row["paths"].items():
            assert path["bitwise"], (row["model"], name)
            assert path["reused"] > 0 or name.startswith("cold run"), (row["model"], name)
    summary = check["summary"]
    assert summary["bitwise_all"] and summary["repeat_bitwise"] and summary["warm_rows_without_reuse"] == []
    assert summary["vision_within_rounding"] is True and summary["max_history"] == 160
    assert summary["cold_prefill_vs_plain"] > 0 and summary["warm_turn_vs_plain_cache"] > 0
    assert speed["summary"]["alone_equals_batched"] and speed["summary"]["static_shapes_bitwise"]


@pytest.mark.slow
def test_a_step_past_its_timeout_is_killed_and_the_next_step_runs(tmp_path):
    code, output = device_run(tmp_path, "--budget", "120", "--only", "speed", "--skip", "streams 4",
                              "--stall", "one stream", "--timeout-scale", "0.1")
    assert code == 1, output  # a step did not finish: the run says so
    speed = json.loads((tmp_path / "gpu_speed_cpu_trial.json").read_text())
    steps = {s["name"]: s["status"] for s in speed["steps"]}
    assert steps == {"one stream": "timeout after 6 s", "bandwidth": "done"}
    assert speed["incomplete"] == ["one stream"] and speed["bandwidth_bytes_s"][0] > 0


def test_the_verdict_refuses_a_warm_row_that_reused_nothing():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import device_check
    finally:
        sys.path.remove(str(SCRIPTS))
    bitwise = {"bitwise": True, "max_abs": 0.0}
    paths = {"cold run #2": {**bitwise, "reused": 0}, "next turn": {**bitwise, "reused": 512},
             "fork": {**bitwise, "reused": 0}}
    report = {"tiny": [], "big": [{"model": "8b", "length": 4096, "chunk": 512, "paths": paths}], "costs": []}
    verdict = device_check.summary(report, 512)
    assert verdict["bitwise_all"] is False and verdict["repeat_bitwise"] is True
    assert verdict["warm_rows_without_reuse"] == ["8b@4096: fork"] and verdict["max_history"] == 0
    assert verdict["reuse"] == {"8b@4096": {"next turn": 512, "fork": 0}}
    paths["fork"]["reused"] = 500
    assert device_check.summary(report, 512)["bitwise_all"] is True
