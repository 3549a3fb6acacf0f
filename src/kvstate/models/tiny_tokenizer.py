"""A character tokenizer for the tiny models, built in memory (no downloads).

Tiny models have random weights and a 128-token vocabulary, so any text tokenizer
that fits serves to drive text paths end to end (``kvstate serve --model tiny:llama``,
the server tests): ids 0-2 are the tiny configs' ``<pad>``, ``<bos>`` and ``<eos>``,
3 is ``<unk>``, then newline and printable ASCII one character per token.
"""

from __future__ import annotations

from typing import Any

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARACTERS = "\n" + "".join(chr(c) for c in range(32, 127))


def tiny_tokenizer(extra: dict[str, int] | None = None) -> Any:
    """A ``PreTrainedTokenizerFast``: one token per character, ``<bos>`` prepended, no chat template.

    ``extra`` maps more special tokens to their ids (the tiny Qwen-VL's vision tokens, 190-193).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIALS, *CHARACTERS))} | dict(extra or {})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in (extra or {})])
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>")
    return tokenizer


QWEN_VL_TOKENS = {"<|image_pad|>": 190, "<|video_pad|>": 191, "<|vision_start|>": 192, "<|vision_end|>": 193}


def tiny_qwen_vl_image_processor() -> Any:
    """A Qwen-VL image processor for the tiny Qwen-VL models: 2x2 patches merged 2x2, images resized
    to at most 16x16 pixels (at most 16 placeholder tokens)."""
    from transformers import Qwen2VLImageProcessorPil  # the PIL backend: no torchvision needed

    return Qwen2VLImageProcessorPil(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=256)
