"""Re-export of ``kvstate.models.tiny_tokenizer`` (``kvstate serve --model tiny:<type>`` uses it)."""

from ..models.tiny_tokenizer import QWEN_VL_TOKENS, tiny_qwen_vl_image_processor, tiny_tokenizer

__all__ = ["QWEN_VL_TOKENS", "tiny_qwen_vl_image_processor", "tiny_tokenizer"]
