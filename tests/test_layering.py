"""The import layering of ``src/kvstate``, checked mechanically: arrows point down only, and nothing is circular.

``LAYERS`` is the order ``docs/architecture.md`` draws, top to bottom. Each module belongs to the layer of the
longest name in it that prefixes the module's (``kvstate.serve.pool`` sits below ``kvstate.serve``). A module
may import modules of its own layer or a lower one, at module level, inside a function, or under
``TYPE_CHECKING`` alike, and the imports between modules (type-only ones aside: they never run) form no cycle.
Imports are read from the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).parent.parent / "src"
ARCHITECTURE = Path(__file__).parent.parent / "docs" / "architecture.md"

LAYERS = [  # top to bottom
    ["kvstate", "kvstate.cli", "kvstate.serve", "kvstate.testing"],
    ["kvstate.verify"],
    ["kvstate.models"],
    ["kvstate.text"],
    ["kvstate.batch"],
    ["kvstate.session"],
    ["kvstate.selfcheck", "kvstate.adopt"],
    ["kvstate.store", "kvstate.serve.pool"],
    ["kvstate.engine"],
    ["kvstate.settings"],
    ["kvstate.request", "kvstate.resume"],
    ["kvstate.compress"],
    ["kvstate.masks", "kvstate.options"],
    ["kvstate.adapters", "kvstate.verdict_cache"],
    ["kvstate.io"],
    ["kvstate._compat"],
    ["kvstate.schedule", "kvstate.protocols", "kvstate.capabilities"],
    ["kvstate.state", "kvstate.layers", "kvstate.identity", "kvstate.errors", "kvstate._version"],
]


def modules() -> list[str]:
    names = []
    for path in sorted((SRC / "kvstate").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def module_path(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def imports(name: str) -> dict[str, bool]:
    """The kvstate modules ``name`` imports, each with whether the import runs (False: under ``TYPE_CHECKING``).
    ``from . import x`` names the submodule ``x``, not the package it is read from."""
    path = module_path(name)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, bool] = {}

    def visit(node: ast.AST, runs: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            runs = False
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1]) if node.level else ""
            source = ".".join(p for p in (base, node.module or "") if p)
            submodules = [f"{source}.{a.name}" for a in node.names if module_path(f"{source}.{a.name}")]
            targets = submodules if len(submodules) == len(node.names) else [source, *submodules]
        for target in targets:
            if target.split(".")[0] == "kvstate" and module_path(target) and target != name:
                found[target] = found.get(target, False) or runs
        for child in ast.iter_child_nodes(node):
            visit(child, runs)

    visit(ast.parse(path.read_text()), True)
    return found


def layer(name: str) -> int:
    best = max((prefix for row in LAYERS for prefix in row if name == prefix or name.startswith(prefix + ".")),
               key=len)
    return next(i for i, row in enumerate(LAYERS) if best in row)


def test_every_module_is_in_a_layer():
    assert all(isinstance(layer(name), int) for name in modules())


def test_no_module_imports_from_a_layer_above_it():
    upward = [f"{name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
              for name in modules() for target in imports(name) if layer(target) < layer(name)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    graph = {name: {t for t, runs in imports(name).items() if runs} for name in modules()}
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_checks_see_what_they_check():
    # the oracle itself, on imports written apart from the code: relative, aliased, in functions, type-only
    assert imports("kvstate.engine.core")["kvstate.engine.batched.prefill"]
    assert "kvstate.session" in imports("kvstate.batch.scheduler")  # imported inside a method
    assert imports("kvstate.engine.batched.prefill").get("kvstate.adapters.binding") is False  # TYPE_CHECKING
    assert "kvstate.io" not in imports("kvstate.io.api")  # `from . import container` names the submodule
    assert layer("kvstate.serve.pool") > layer("kvstate.serve.app") and layer("kvstate.engine.batched.pool") == \
        layer("kvstate.engine")
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"] and _cycle({"a": {"b"}}) is None


def test_the_architecture_document_draws_these_layers():
    # docs/architecture.md's diagram lists the same layers in the same order (its first column, one row each)
    block = ARCHITECTURE.read_text().split("```")[1]
    drawn = [re.findall(r"(?:^|\s{2})([\w/.]+(?:\.py|/))(?=\s)", line + " ")
             for line in block.strip().splitlines()]
    names = [sorted("kvstate" if p == "__init__.py" else "kvstate." + p.removesuffix(".py").removesuffix("/")
                    .replace("/", ".") for p in row) for row in drawn if row]
    assert names == [sorted(row) for row in LAYERS]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := walk(start)):
            return found
    return None
