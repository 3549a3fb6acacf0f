"""Test helpers: the library's tiny models plus the project tolerance."""

from __future__ import annotations

from kvstate.testing import assert_logits_close
from kvstate.testing.tiny import CONFIGS, SLIDING, WINDOW, tiny_config, tiny_model
from kvstate.testing.tiny import tiny_prompt as prompt

__all__ = ["CONFIGS", "SLIDING", "WINDOW", "assert_logits_close", "prompt", "tiny_config", "tiny_model"]

