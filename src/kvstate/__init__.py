"""kvstate: explicit, portable, provably exact generation state for transformers models.

The top level holds what a user needs (``__all__``); everything else lives in its
subpackage (``kvstate.errors``, ``kvstate.layers``, ``kvstate.adapters``, ``kvstate.compress``).
Names are imported on first use (PEP 562), so ``import kvstate`` and ``kvstate --help``
do not load torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._compat import versions as _versions
from ._version import __version__ as __version__

_versions.check()  # a transformers outside the tested window: one line naming it (docs/versions.md)

# The public surface: what a user needs to run, keep and move generation state.
_PUBLIC = {
    "Session": "session", "State": "state", "PrefixStore": "store",
    "save_state": "io", "load_state": "io", "inspect_state": "io", "continue_text": "text",
    "KVStateError": "errors", "InputError": "errors", "UnsupportedError": "errors", "StateFileError": "errors",
}
# Names the top level exported before core v3, still resolved for old code; each has its home in a subpackage.
_COMPATIBLE = {
    "StoreWarning": "errors", "RollbackError": "errors", "UnsupportedModelError": "errors",
    "LayerState": "layers", "AttentionLayerState": "layers", "ResumePlan": "resume",
    "Fingerprint": "identity", "fingerprint": "adapters.fingerprinting",
    "Adapter": "adapters", "Capabilities": "adapters", "register": "adapters", "supported_model_types": "adapters",
}
_EXPORTS = {**_PUBLIC, **_COMPATIBLE}
__all__ = [
    "InputError",
    "KVStateError",
    "PrefixStore",
    "Session",
    "State",
    "StateFileError",
    "UnsupportedError",
    "continue_text",
    "inspect_state",
    "load_state",
    "save_state",
]

if TYPE_CHECKING:
    from .errors import InputError, KVStateError, StateFileError, UnsupportedError
    from .io import inspect_state, load_state, save_state
    from .session import Session
    from .state import State
    from .store import PrefixStore
    from .text import continue_text


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstate' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
