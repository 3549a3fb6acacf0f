"""kvstate's own version, with one source: ``pyproject.toml``, read back from the installed metadata.

A source tree on ``sys.path`` without an install has no metadata; it reads the
``pyproject.toml`` beside ``src/`` instead, and says ``0+unknown`` when that is missing too.
No kvstate module is imported here, so ``io`` can stamp files without loading the package root.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

UNKNOWN = "0+unknown"


def _from_source_tree(pyproject: Path) -> str:
    try:
        return str(tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return UNKNOWN


def _version() -> str:
    try:
        return importlib.metadata.version("kvstate")
    except importlib.metadata.PackageNotFoundError:
        return _from_source_tree(Path(__file__).resolve().parents[2] / "pyproject.toml")


__version__ = _version()
