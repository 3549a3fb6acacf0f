"""KV compression that resumes correctly: policies, per-layer masks, key re-rotation."""

from .apply import decode_with_budget
from .policies import (
    TOVA,
    KNorm,
    MediaSpans,
    Needs,
    PerLayerBudget,
    Policy,
    Random,
    ReRotate,
    ScoreInput,
    SnapKV,
    StreamingLLM,
    Wrapper,
)
from .scoring import KVZIP_PROMPT, ExpectedAttention, KVzip, kvzip_prompt

__all__ = [
    "KVZIP_PROMPT",
    "TOVA",
    "ExpectedAttention",
    "KNorm",
    "KVzip",
    "MediaSpans",
    "Needs",
    "PerLayerBudget",
    "Policy",
    "Random",
    "ReRotate",
    "ScoreInput",
    "SnapKV",
    "StreamingLLM",
    "Wrapper",
    "decode_with_budget",
    "kvzip_prompt",
]
