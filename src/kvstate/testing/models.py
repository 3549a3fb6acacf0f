"""Re-export of ``kvstate.models`` (model specs are production loading: the CLI and the server use them)."""

from ..models import ATTENTION_BACKENDS, load_model

__all__ = ["ATTENTION_BACKENDS", "load_model"]
