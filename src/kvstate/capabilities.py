"""``Capabilities``: what a model family can do, as values (read by the planner, the engine and the session).

Declared once per adapter (``kvstate.adapters``); nothing probes a model with ``hasattr``.
A value below the seams, so ``kvstate.protocols`` can name it without importing the adapters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a family can do, as values (read by the planner, the engine and the session).

    Attributes:
        name: the adapter's name, for messages.
        position_dims: ``R``; positions are ``[B, S]`` when 1, else ``[B, S, R]`` (multimodal RoPE).
        stepwise: transformers drops state on multi-token chunks after position 0, so
            continuations are fed one token per forward.
        position_ids: the model takes explicit ``position_ids``.
        padding: padded (left-padded) batches are supported.
        input_keys: extra model inputs tied to token slots (e.g. ``pixel_values``).
        logits_to_keep: the model's forward takes ``logits_to_keep``.
        rollback: cropping attention layers returns the model to an earlier state exactly
            (False when the self-check found state outside the cache: then only
            continuing or re-feeding is allowed).
        cache_kwarg: the ``forward`` / ``generate`` keyword the cache travels in (RWKV: ``state``);
            None: the one the model's ``forward`` takes (it moved between transformers versions).
        head_masks: the attention takes a mask per query head (``[B, Hq, Q, K]``), so each KV head of a
            compressed layer may keep its own slots; False: compression keeps one slot set per layer.
    """

    name: str = "generic-decoder"
    position_dims: int = 1
    stepwise: bool = False
    position_ids: bool = True
    padding: bool = True
    input_keys: tuple[str, ...] = ()
    logits_to_keep: bool = True
    rollback: bool = True
    cache_kwarg: str | None = None
    head_masks: bool = True
