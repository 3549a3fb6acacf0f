"""``kvstate verify --against URL``: are an OpenAI-compatible server's cache hits exact? (verify --against)

Each scenario sends the very same request warm (after primers filled the server's cache)
and cold (to a reference), then compares the answers; the pattern of failures names the
fault, as ``kvstate verify`` does for one model. ``client`` speaks HTTP (standard library
only), ``scenarios`` builds the probes, ``run`` drives them, ``report`` judges and renders,
``diagnose`` reads the pattern. Guide: docs/against.md.
"""

from __future__ import annotations

from .report import Report
from .run import Options, run_against
from .scenarios import NAMES

__all__ = ["NAMES", "Options", "Report", "run_against"]
