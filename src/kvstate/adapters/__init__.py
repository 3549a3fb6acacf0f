"""Per-family adapters behind one explicit registry (see ``base`` for the protocol)."""

from .base import Adapter, Capabilities, register, registered, supported_model_types
from .gemma3 import Gemma3Adapter
from .own_cache import MiniMaxAdapter, RWKVAdapter, XLSTMAdapter
from .qwen_vl import QwenVLAdapter
from .recurrent import RecurrentAdapter, RecurrentGemmaAdapter

__all__ = ["Adapter", "Capabilities", "Gemma3Adapter", "MiniMaxAdapter", "QwenVLAdapter", "RWKVAdapter",
           "RecurrentAdapter", "RecurrentGemmaAdapter", "XLSTMAdapter", "register", "registered",
           "supported_model_types"]

# Each registration is exercised by the test matrix (tests/test_core.py, tests/test_families.py).
register(("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"), Adapter())
register(("qwen2_vl", "qwen2_5_vl"), QwenVLAdapter())
register(("qwen3_vl",), QwenVLAdapter(frame_runs=True))  # one placeholder run per video frame
register(("lfm2",), RecurrentAdapter(family="lfm2"))
register(("qwen3_next", "falcon_h1"), RecurrentAdapter())
register(("mamba2",), RecurrentAdapter(position_ids=False))
register(("mamba",), RecurrentAdapter(position_ids=False, scan_from_cache="transformers.models.mamba.modeling_mamba"))
register(("jamba",), RecurrentAdapter(scan_from_cache="transformers.models.jamba.modeling_jamba"))
register(("recurrent_gemma",), RecurrentGemmaAdapter())
register(("minimax",), MiniMaxAdapter())
register(("xlstm",), XLSTMAdapter())
register(("rwkv",), RWKVAdapter())
register(("gemma3",), Gemma3Adapter())  # images: bidirectional blocks, token types over the whole history
