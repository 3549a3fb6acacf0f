"""Re-export of ``kvstate.models.default`` (the embedded default model is production loading)."""

from ..models.default import (
    GOOD_GGUF_TOKENIZER,
    KNOWN_IDS,
    KNOWN_SENTENCE,
    PACKAGE,
    check_tokenizer,
    default_model_folder,
    gguf_path,
    load_default_model,
)

__all__ = ["GOOD_GGUF_TOKENIZER", "KNOWN_IDS", "KNOWN_SENTENCE", "PACKAGE", "check_tokenizer",
           "default_model_folder", "gguf_path", "load_default_model"]
