"""Helpers for tests; no module outside this package imports it (tests/test_packaging.py checks).

* ``assert_logits_close``: the project tolerance, max |Δ| <= 1e-5 x max |reference|.
* ``tiny``, ``shrink``, ``tiny_tokenizer``, ``default_model``, ``models``: re-exports of the
  model loading that moved to ``kvstate.models`` (the CLI and the server need it), kept so
  existing imports work. Testing may import production, never the reverse.
"""

from __future__ import annotations

import torch

from ..models import load_default_model, load_model
from ..models.tiny import image_span, tiny_config, tiny_image, tiny_model, tiny_prompt

__all__ = ["assert_logits_close", "image_span", "load_default_model", "load_model", "tiny_config", "tiny_image",
           "tiny_model", "tiny_prompt"]

TOLERANCE = 1e-5  # relative to max |reference logit|, fp32


def assert_logits_close(actual: torch.Tensor, reference: torch.Tensor, what: str = "logits") -> None:
    """Raise ``AssertionError`` unless max |Δ| <= 1e-5 x max |reference| (fp32)."""
    delta = (actual.float() - reference.float()).abs().max().item()
    bound = TOLERANCE * reference.float().abs().max().item()
    if not delta <= bound:
        raise AssertionError(f"{what}: max |Δ| = {delta:.3e} > {bound:.3e}")
