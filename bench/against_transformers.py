"""`kvstate verify --against` on `transformers serve`: it does not cache prompts.

Starts `transformers serve` on the default model's folder (float32, with kvstate's fallback chat template,
as ``bench_serve.py`` does) and runs ``kvstate verify --against`` on it with no cold twin. Without a
prompt cache no warm request can show a hit, so the expected verdict is exit 3 (inconclusive), stated as
such. Writes ``bench/results/against_transformers.{json,md}``.

    python bench/against_transformers.py          # a few minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import _free_port, _model_folder, _server
from common import RESULTS, environment


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="kvstate-against-tf-"))
    try:
        folder = _model_folder(work)
        port = _free_port()
        cmd = [str(Path(sys.executable).parent / "transformers"), "serve", str(folder), "--port", str(port),
               "--log-level", "warning", "--host", "127.0.0.1"]
        markdown = RESULTS / "against_transformers.md"
        with _server(cmd, port, os.cpu_count() or 1) as url:
            run = subprocess.run([sys.executable, "-m", "kvstate.cli", "verify", "--against", url, "--served-model",
                                  str(folder), "--json", "--markdown", str(markdown)],
                                 capture_output=True, text=True, timeout=900)
        report = json.loads(run.stdout) if run.stdout.strip().startswith("{") else {"stdout": run.stdout}
        result = {"env": environment(), "server": "transformers serve (no prompt cache), default model, float32",
                  "exit_code": run.returncode, "stderr_tail": run.stderr[-2000:], "report": report}
        (RESULTS / "against_transformers.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"kvstate verify --against transformers serve: exit {run.returncode}")
        print(run.stderr[-2000:])
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
