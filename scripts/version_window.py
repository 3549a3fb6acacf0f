"""Run the compatibility subset (``pytest -m window``) on every transformers minor in the window.

One virtual environment per version under ``--root`` (torch from pip's cache, kvstate
installed editable with its test extra, then the transformers version pinned), the
subset run in it, and a table of version -> passed / failed / skipped and seconds written
to ``bench/results/version_window.json`` and ``docs/versions.md``. The subset covers
every family adapter, the state files, compression, verify and the cross-version files.

    python scripts/version_window.py                        # the newest patch of every minor, ~35 min
    python scripts/version_window.py --versions 5.14.1,5.24.0
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))
from common import write_results  # noqa: E402
from kvstate._compat import versions  # noqa: E402

TORCH = "torch==2.13.0"


def newest_patches() -> list[str]:
    """The newest patch of every minor in the window, from the package index."""
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers"], capture_output=True,
                         text=True, check=True).stdout
    available = re.search(r"Available versions: (.*)", out).group(1).split(", ")  # type: ignore[union-attr]
    best: dict[tuple[int, int], str] = {}
    for v in available:
        if re.fullmatch(r"\d+\.\d+\.\d+", v) and versions.in_window(v):
            key = versions.minor(v)
            if key not in best or tuple(map(int, v.split("."))) > tuple(map(int, best[key].split("."))):
                best[key] = v
    return [best[k] for k in sorted(best)]


def run(version: str, root: Path, other: str | None) -> dict[str, object]:
    venv = root / version
    python = venv / "bin" / "python"
    started = time.perf_counter()
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = [[str(python), "-m", "pip", "install", "-q", TORCH],
               [str(python), "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]", f"transformers=={version}"]]
    for command in install:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            return {"version": version, "ok": False, "error": done.stderr[-2000:]}
    installed = time.perf_counter()
    env = dict(os.environ)
    if other is not None and versions.installed() != version:  # files saved here continue there, and back
        env["KVSTATE_OTHER_PYTHON"] = other
    test = subprocess.run([str(python), "-m", "pytest", "-m", "window", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    tail = test.stdout.strip().splitlines()[-1] if test.stdout.strip() else test.stderr[-500:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail)}
    row = {"version": version, "ok": test.returncode == 0, **counts, "summary": tail,
           "install_seconds": round(installed - started, 1), "test_seconds": round(time.perf_counter() - installed, 1)}
    if test.returncode:
        row["failures"] = [line for line in test.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))][:20]
    print(f"{version}: {tail} ({row['test_seconds']} s)", flush=True)
    return row


def refused(version: str, root: Path) -> dict[str, object]:
    """A version below the window: kvstate installed without dependencies, and ``import kvstate`` must
    fail with the one-line error that names the window."""
    venv = root / version
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    for command in ([str(python), "-m", "pip", "install", "-q", TORCH, f"transformers=={version}"],
                    [str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)]):
        subprocess.run(command, check=True, capture_output=True)
    done = subprocess.run([str(python), "-c", "import kvstate"], capture_output=True, text=True, cwd="/")
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    ok = done.returncode != 0 and "TransformersVersionError" in last and versions.window() in last
    print(f"{version}: import refused: {ok}: {last}", flush=True)
    return {"version": version, "ok": ok, "expect": "import refused", "message": last}


def markdown(rows: list[dict[str, object]]) -> str:
    lines = ["| transformers | subset | passed | failed | skipped | seconds |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("expect") == "import refused":
            lines.append(f"| {r['version']} | `import kvstate` refused{'' if r['ok'] else ' **NOT**'}: "
                         f"`{str(r['message'])[:90]}…` | | | | |")
            continue
        lines.append(f"| {r['version']} | {'pass' if r['ok'] else '**FAIL**'} | {r.get('passed', 0)} | "
                     f"{r.get('failed', 0) + r.get('error', 0) + r.get('errors', 0)} | {r.get('skipped', 0)} | "
                     f"{r.get('test_seconds', '')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", help="comma-separated versions (default: the newest patch of every minor)")
    parser.add_argument("--root", type=Path, default=Path("/tmp/kvstate-window"), help="where the venvs go")
    parser.add_argument("--below", default="5.13.1", help="a version below the window, to check the refusal")
    parser.add_argument("--other-python", default=sys.executable,
                        help="a Python with another transformers, for the cross-version files (default: this one)")
    args = parser.parse_args()
    chosen = args.versions.split(",") if args.versions else newest_patches()
    args.root.mkdir(parents=True, exist_ok=True)
    rows = [run(v, args.root, args.other_python) for v in chosen]
    if args.below:
        rows.append(refused(args.below, args.root))
    write_results("version_window", {"window": versions.window(), "subset": "pytest -m window", "rows": rows})
    table = markdown(rows)
    doc = ROOT / "docs" / "versions.md"
    text = doc.read_text()
    start, end = "<!-- window-table -->", "<!-- /window-table -->"
    doc.write_text(text.split(start)[0] + f"{start}\n{table}\n{end}" + text.split(end)[1])
    print(table)


if __name__ == "__main__":
    main()
