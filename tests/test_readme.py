"""The README's example runs as written and prints what its comments claim."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
README = Path(__file__).parent.parent / "README.md"


def test_readme_example_runs():
    text = README.read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {})
    claimed = re.search(r"# (ResumePlan\(.*?\))", code).group(1)
    assert out.getvalue().strip() == claimed


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    text = README.read_text()
    setup = text.split("## Set-up")[1].split("\n## ")[0]
    commands = re.findall(r"```\n(.*?)\n```", setup, re.S)
    assert len(commands) == 2 and commands[0].endswith("kvstate verify")
    ci = (README.parent / ".ci" / "run").read_text()
    assert commands[1] in ci
