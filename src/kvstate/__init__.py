"""kvstate: explicit, portable, provably exact generation state for transformers models.

Names are imported on first use (PEP 562), so ``import kvstate`` and ``kvstate --help``
do not load torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._compat import versions as _versions
from ._version import __version__ as __version__

_versions.check()  # a transformers outside the tested window: one line naming it (docs/versions.md)

_EXPORTS = {
    "Session": "session", "StoreWarning": "errors",
    "State": "state", "LayerState": "layers", "AttentionLayerState": "layers",
    "ResumePlan": "resume",
    "PrefixStore": "store",
    "save_state": "io", "load_state": "io", "inspect_state": "io",
    "Fingerprint": "identity", "fingerprint": "adapters.fingerprinting",
    "Adapter": "adapters", "Capabilities": "adapters", "register": "adapters", "supported_model_types": "adapters",
    "continue_text": "text",
    "KVStateError": "errors", "InputError": "errors", "RollbackError": "errors", "StateFileError": "errors",
    "UnsupportedError": "errors", "UnsupportedModelError": "errors",
}
__all__ = [
    "Adapter",
    "AttentionLayerState",
    "Capabilities",
    "Fingerprint",
    "InputError",
    "KVStateError",
    "LayerState",
    "PrefixStore",
    "ResumePlan",
    "RollbackError",
    "Session",
    "State",
    "StateFileError",
    "StoreWarning",
    "UnsupportedError",
    "UnsupportedModelError",
    "continue_text",
    "fingerprint",
    "inspect_state",
    "load_state",
    "register",
    "save_state",
    "supported_model_types",
]

if TYPE_CHECKING:
    from .adapters import Adapter, Capabilities, register, supported_model_types
    from .adapters.fingerprinting import fingerprint
    from .errors import (
        InputError,
        KVStateError,
        RollbackError,
        StateFileError,
        StoreWarning,
        UnsupportedError,
        UnsupportedModelError,
    )
    from .identity import Fingerprint
    from .io import inspect_state, load_state, save_state
    from .layers import AttentionLayerState, LayerState
    from .resume import ResumePlan
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
    return sorted([*globals(), *_EXPORTS])
