"""Re-export of ``kvstate.models.shrink`` (the auto-shrinker moved to production for ``--model tiny:<type>``)."""

from ..models.shrink import shrink_config, tiny_causal_lm

__all__ = ["shrink_config", "tiny_causal_lm"]
