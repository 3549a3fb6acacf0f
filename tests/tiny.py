"""Test helpers: the library's tiny models plus the project tolerance."""

from __future__ import annotations

import torch

from kvstate.tiny import CONFIGS, SLIDING, WINDOW, tiny_config, tiny_model
from kvstate.tiny import tiny_prompt as prompt

__all__ = ["CONFIGS", "SLIDING", "WINDOW", "assert_logits_close", "prompt", "tiny_config", "tiny_model"]


def assert_logits_close(actual: torch.Tensor, reference: torch.Tensor, what: str = "logits") -> None:
    """The project tolerance: max |Δ| <= 1e-5 x max |reference| (fp32)."""
    delta = (actual.float() - reference.float()).abs().max().item()
    bound = 1e-5 * reference.float().abs().max().item()
    assert delta <= bound, f"{what}: max |Δ| = {delta:.3e} > {bound:.3e}"
