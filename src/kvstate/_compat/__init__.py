"""Every contact with transformers internals (and with torch's private ops) lives in this package.

``versions`` holds the tested window (checked on ``import kvstate``), ``core`` the cache and
model-side helpers, ``generation`` the seams of ``generate``, ``own_cache`` the models with a cache class of their own,
``scan`` the Mamba selective scan, ``watch`` the attention listener that compression scores with,
``attention`` the attention path of kvstate's forwards (deterministic kernels on CUDA). ``core`` loads
on first attribute access, so the version gate runs before torch or transformers import.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("attention", "core", "generation", "own_cache", "scan", "versions", "watch")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES or name.startswith("__"):  # let the import system load submodules itself
        raise AttributeError(name)
    for sub in ("core", "generation", "own_cache"):
        module = importlib.import_module(f"{__name__}.{sub}")
        if hasattr(module, name):
            break
    value = getattr(module, name)
    globals()[name] = value
    return value
