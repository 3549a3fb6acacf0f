"""Batched generation: many conversations decode in one forward, and each answer is bit for bit
what it gets alone (continuous batching; ``docs/batching.md``).

``generate_many(model, requests)`` answers a list of ``BatchRequest`` s; ``Scheduler`` is the
continuous-batching loop under it (submit, step, cancel), for servers; its requests and events are
in ``events``. The prompts a step admits are prefilled in one tiled forward (``kvstate.engine.batched.prefill``),
and prompts admitted in later steps share their common prefix (``prefixes``).
"""

from .sampling import Choice, Sampling
from .scheduler import BatchRequest, Completion, Done, Failed, Scheduler, Token, batch_settings, generate_many

__all__ = ["BatchRequest", "Choice", "Completion", "Done", "Failed", "Sampling", "Scheduler", "Token", "batch_settings",
           "generate_many"]
