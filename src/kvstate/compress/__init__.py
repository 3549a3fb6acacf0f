"""KV compression that resumes correctly: policies, per-layer masks, key re-rotation."""

from .apply import decode_with_budget
from .policies import (
    TOVA,
    KNorm,
    MediaSpans,
    PerLayerBudget,
    Policy,
    Random,
    ReRotate,
    ScoreInput,
    SnapKV,
    StreamingLLM,
)

__all__ = [
           "TOVA",
           "KNorm",
           "MediaSpans",
           "PerLayerBudget",
           "Policy",
           "Random",
           "ReRotate",
           "ScoreInput",
           "SnapKV",
           "StreamingLLM",
           "decode_with_budget",
]
