"""KV compression that resumes correctly: policies, per-head slot sets, global budgets, key re-rotation.

``session.compress(KVzip(0.5))`` evicts half the K/V entries of the attention layers, chosen per KV head
by one ranking across layers and heads; every retained slot keeps its logical position, so the
continuation is exactly attention restricted to the retained slots (docs/compression.md).
"""

from .during import decode_with_budget
from .expected import ExpectedAttention
from .kvzip import KVZIP_PROMPT, KVzip, kvzip_prompt
from .policies import TOVA, KNorm, Needs, Policy, Random, Ranked, Ranking, ScoreInput, SnapKV, StreamingLLM
from .report import Compression, compression
from .wrappers import ChunkKV, Keep, MediaSpans, PerLayerBudget, ReRotate, Wrapper

__all__ = [
    "KVZIP_PROMPT",
    "TOVA",
    "ChunkKV",
    "Compression",
    "ExpectedAttention",
    "KNorm",
    "KVzip",
    "Keep",
    "MediaSpans",
    "Needs",
    "PerLayerBudget",
    "Policy",
    "Random",
    "Ranked",
    "Ranking",
    "ReRotate",
    "ScoreInput",
    "SnapKV",
    "StreamingLLM",
    "Wrapper",
    "compression",
    "decode_with_budget",
    "kvzip_prompt",
]
