"""``kvstate verify``: the generation-equivalence control matrix and its diagnosis, for any model.

Every row continues the same prompt through one path and compares first-step logits
and greedy tokens with a fresh full-sequence run on plain transformers (``run``,
``rows``, ``contract``); ``diagnose`` follows the long seed's decision tree;
``report`` renders tables, Markdown and JSON. Names load on first use, so the CLI's
parser can import ``faults`` without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .faults import FAULTS

_EXPORTS = {"verify": "run", "DEFAULT_PROMPT": "run", "TOLERANCE": "report", "Finding": "report",
            "Report": "report", "Row": "report", "compare": "report"}
__all__ = ["FAULTS", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstate.verify' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
