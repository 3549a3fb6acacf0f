"""The engine: the only caller of the model (``core``), what each forward saw (``recorder``),
and the schedules it runs: canonical prefill chunks (``kvstate.schedule``), budgeted
compression rounds (``budgeted``), and batch-invariant decode steps of many conversations
(``decode``, with ``invariant``'s tiled matrix products; continuous batching)."""

from ..request import Feed
from .core import Engine
from .recorder import Forward, Recorder, model_lock
from .values import Outcome, finish_reasons

__all__ = ["Engine", "Feed", "Forward", "Outcome", "Recorder", "finish_reasons", "model_lock"]
