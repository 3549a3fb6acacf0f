"""KVzip's re-read as its reference asks for it: the instruction inside the model's chat turn.

The reference (Kim et al. 2025; kvpress's ``KVzipPress``) feeds, after the context,
``instruction + suffix + chunk``, where the instruction is "Repeat the previous context
exactly." (later chunks: "Repeat the part of the previous context exactly, starting with"
and the previous chunk's last 8 tokens), and ``suffix`` is what the tokenizer's chat
template writes between a user message and the assistant's answer. A tokenizer without a
template gets ``"\\n"`` as the suffix; a model without any tokenizer re-reads its context
with no instruction. ``prefix`` is what the template writes before the user's content (a
system prompt, the user header): the reference keeps those tokens as its sinks and re-reads
only the context after them (``KVzip(prefix=...)``). The tokenizer is the session's, else
the one in the model's folder (``model.name_or_path``, tokenizer files or a GGUF as
``kvstate.models`` loads them), so ``KVzip(0.5)`` needs no tokenizer argument.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"
_DUMMY = "dummy context"


@dataclass(frozen=True)
class Reread:
    """Token ids around each re-read chunk: ``first`` (or ``later`` + the previous chunk's last tokens), then
    ``suffix``, then the chunk. ``prefix``: the template's tokens before the user's content (``()`` without a
    template). ``how``: ``"chat template"``, ``"raw text"`` or ``"none"``."""

    first: tuple[int, ...] = ()
    later: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    how: str = "none"
    prefix: tuple[int, ...] = ()


def reread_for(model: Any, tokenizer: Any = None) -> Reread:
    """The re-read of ``model``: from ``tokenizer`` if given, else from the tokenizer in the model's folder."""
    if tokenizer is not None and callable(getattr(tokenizer, "encode", None)):
        return _from_tokenizer(tokenizer)
    folder = str(getattr(model, "name_or_path", "") or "")
    return _from_folder(folder) if folder and os.path.isdir(folder) else Reread()


@functools.lru_cache(maxsize=8)
def _from_folder(folder: str) -> Reread:
    """The re-read from a model folder's tokenizer (loaded once per folder and process)."""
    from transformers import AutoTokenizer

    ggufs = sorted(p.name for p in Path(folder).glob("*.gguf"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError):
        if not ggufs:
            return Reread()
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=ggufs[0], local_files_only=True)
        except (OSError, ValueError, TypeError):
            return Reread()
    return _from_tokenizer(tokenizer)


def _from_tokenizer(tokenizer: Any) -> Reread:
    def ids(text: str) -> tuple[int, ...]:
        return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))

    suffix, prefix, how = "\n", "", "raw text"
    if getattr(tokenizer, "chat_template", None):
        separator = "\n" + "#" * len(_DUMMY)
        try:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": _DUMMY + separator}],
                                                     add_generation_prompt=True, tokenize=False,
                                                     enable_thinking=False)
        except Exception:  # a template that needs more than one user message: the raw-text re-read
            rendered = None
        if isinstance(rendered, str) and separator in rendered:
            head, suffix = rendered.split(separator)
            prefix, how = head.split(_DUMMY)[0], "chat template"
    return Reread(ids(FIRST), ids(LATER), ids(suffix), how, ids(prefix) if prefix else ())
