"""What users read: a README for users (at most ~300 lines, the deep dives in docs/), and no internal
issue numbers in the README, docs/, error texts or the command line's help: they name the feature."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from kvstate.cli import _parser

ROOT = Path(__file__).parent.parent
ISSUE = re.compile(r"[Ii]ssues? #?[0-9]+")


def test_the_readme_is_for_users_and_short():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    headings = re.findall(r"^## (.*)$", text, re.M)
    for section in ("Set-up", "Example", "The main job: `kvstate verify`", "The server: `kvstate serve`", "On a GPU"):
        assert any(h.startswith(section) for h in headings), (section, headings)
    assert "docs/benchmarks.md" in text and "| history |" not in text  # measurement tables live in docs/


def test_no_internal_issue_numbers_in_the_readme_or_docs():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").iterdir())]:
        found = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if ISSUE.search(line)]
        assert not found, f"{path.name}: {found[:3]}"


def test_no_internal_issue_numbers_in_help_or_messages():
    parser = _parser()
    commands = next(a for a in parser._actions if a.choices and "verify" in a.choices).choices
    for name, sub in {"kvstate": parser, **commands}.items():
        assert not ISSUE.search(sub.format_help()), name
    for path in sorted((ROOT / "src" / "kvstate").rglob("*.py")):  # string literals other than docstrings
        tree = ast.parse(path.read_text())
        docs = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and node.body and isinstance(node.body[0], ast.Expr)}
        texts = [node for node in ast.walk(tree)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]
        found = [(node.lineno, node.value[:80]) for node in texts if ISSUE.search(node.value)]
        assert not found, f"{path.relative_to(ROOT)}: {found}"
