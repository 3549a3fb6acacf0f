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


def tiny_tokenizer() -> Any:
    """A ``PreTrainedTokenizerFast``: one token per character, ``<bos>`` prepended, no chat template."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIALS, *CHARACTERS))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>",
                                        pad_token="<pad>", unk_token="<unk>")
    return tokenizer
