"""kvstate: explicit, portable, provably exact generation state for transformers models."""

from .adapters import Adapter, register, supported_model_types
from .errors import (
    KVStateError,
    RollbackError,
    StateFileError,
    UnsupportedError,
    UnsupportedModelError,
)
from .files import inspect_state, load_state, save_state
from .fingerprint import Fingerprint, fingerprint
from .layers import AttentionLayerState, LayerState
from .session import ResumePlan, Session
from .state import State
from .store import PrefixStore

__all__ = [
    "Adapter",
    "AttentionLayerState",
    "Fingerprint",
    "KVStateError",
    "LayerState",
    "PrefixStore",
    "ResumePlan",
    "RollbackError",
    "Session",
    "State",
    "StateFileError",
    "UnsupportedError",
    "UnsupportedModelError",
    "fingerprint",
    "inspect_state",
    "load_state",
    "register",
    "save_state",
    "supported_model_types",
]
__version__ = "0.1.0"
