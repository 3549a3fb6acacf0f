"""The never-rules: the immutable data imports neither the transformers bridge nor the adapters.

Read from the source with ``ast`` (no import runs), following every kvstate module the data
modules import, so a rule broken two hops away (``state`` → a helper → ``_compat``) still fails.
Imports under ``if TYPE_CHECKING:`` are skipped: they never run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parent.parent / "src"
FORBIDDEN = ("kvstate._compat", "kvstate.adapters")


def module_path(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _walk_running(tree: ast.AST):
    """Every node except the bodies of ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(child for child in ast.iter_child_nodes(node) if not _type_checking_only(child))


def direct_imports(name: str) -> set[str]:
    """The kvstate modules ``name`` imports (absolute names, relative ones resolved)."""
    path = module_path(name)
    package = name if path is not None and path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _walk_running(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1]) if node.level else ""
            target = ".".join(p for p in (base, node.module or "") if p)
            out.add(target)
            # `from . import x` and `from .pkg import mod` may name a submodule
            out |= {f"{target}.{alias.name}" for alias in node.names if module_path(f"{target}.{alias.name}")}
    return {m for m in out if m.startswith("kvstate.") and module_path(m)}


def parents(name: str) -> list[str]:
    """Packages an import of ``name`` runs first (not the root: its version check is allowed)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def reached(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(m for imported in direct_imports(name) for m in (*parents(imported), imported))
    return seen


@pytest.mark.parametrize("module", ["kvstate.state", "kvstate.layers", "kvstate.identity"])
def test_the_data_modules_import_neither_compat_nor_adapters(module):
    bad = sorted(m for m in reached(module) if m.startswith(FORBIDDEN))
    assert not bad, f"{module} reaches {bad}; a state is data and must load without the model bridge"


def test_the_walk_follows_imports_through_hops():
    # the oracle itself: session.py reaches the bridge only through the adapters package
    assert {"kvstate.identity", "kvstate.layers", "kvstate.errors"} <= reached("kvstate.state")
    assert {"kvstate.adapters.fingerprinting", "kvstate._compat.core"} <= reached("kvstate.session")


def test_importing_the_state_loads_neither_transformers_nor_the_bridge():
    code = ("import sys, kvstate.state, kvstate.layers; print(sorted(m for m in sys.modules "
            "if m.startswith(('kvstate._compat', 'kvstate.adapters', 'transformers'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # the package root checks the transformers version window (by metadata, without importing it)
    assert done.stdout.strip() == "['kvstate._compat', 'kvstate._compat.versions']"


def test_the_root_fingerprint_is_the_function_after_the_data_modules_load():
    # a submodule named `fingerprint` used to shadow the function once anything imported it
    import kvstate
    import kvstate.state

    assert callable(kvstate.fingerprint) and kvstate.fingerprint.__module__ == "kvstate.adapters.fingerprinting"
    assert kvstate.Fingerprint.__module__ == "kvstate.identity"


def test_one_version_from_the_metadata_with_the_pyproject_as_fallback(tmp_path):
    import importlib.metadata
    import tomllib

    import kvstate
    from kvstate import _version
    from kvstate.io.schema import created_with

    pyproject = SRC.parent / "pyproject.toml"
    declared = tomllib.loads(pyproject.read_text())["project"]["version"]
    assert kvstate.__version__ == created_with()["kvstate"] == importlib.metadata.version("kvstate") == declared
    assert _version._from_source_tree(pyproject) == declared  # a source tree without an install
    assert _version._from_source_tree(tmp_path / "pyproject.toml") == "0+unknown"


# name formerly at the top level: its home now
MOVED = {
    "StoreWarning": "kvstate.errors", "RollbackError": "kvstate.errors", "UnsupportedModelError": "kvstate.errors",
    "LayerState": "kvstate.layers", "AttentionLayerState": "kvstate.layers", "ResumePlan": "kvstate.resume",
    "Fingerprint": "kvstate.identity", "fingerprint": "kvstate.adapters.fingerprinting",
    "Adapter": "kvstate.adapters", "Capabilities": "kvstate.adapters", "register": "kvstate.adapters",
    "supported_model_types": "kvstate.adapters",
}


def test_the_top_level_is_what_a_user_needs():
    import kvstate

    assert sorted(kvstate.__all__) == ["InputError", "KVStateError", "PrefixStore", "Session", "State",
                                       "StateFileError", "UnsupportedError", "continue_text", "inspect_state",
                                       "load_state", "save_state"]
    assert all(getattr(kvstate, name) is not None for name in kvstate.__all__)
    fresh = subprocess.run([sys.executable, "-c", "import kvstate; print(' '.join(dir(kvstate)))"],
                           capture_output=True, text=True, timeout=300)
    shown = set(fresh.stdout.split())
    assert set(kvstate.__all__) <= shown and not set(MOVED) & shown, fresh.stderr[-2000:]


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_still_resolves_at_the_top_level(name):
    import importlib

    import kvstate

    assert name not in kvstate.__all__
    assert getattr(kvstate, name) is getattr(importlib.import_module(MOVED[name]), name)
