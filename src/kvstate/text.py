"""Continuing a state with more *text*, exactly as a fresh run on the whole text would.

Tokenizing new text on its own and appending its ids changes the answer: tokens can
merge across the boundary ("doc" + "ument" is not "document"), and a fresh run never
sees a second BOS. ``history_ids`` therefore re-tokenizes the processed tokens' text
plus the new text as one string, and ``Session.generate`` resumes from the longest
common token prefix. The answer is then the fresh run's.
"""

from __future__ import annotations

from typing import Any

import torch


def history_ids(tokenizer: Any, processed: torch.Tensor, text: str) -> torch.Tensor:
    """Ids ``[1, L]`` of ``processed`` ``[1, T]`` (decoded) followed by ``text``, tokenized as one string.

    An empty ``processed`` gives ``tokenizer(text)``, special tokens included, as a fresh
    run does. Otherwise the processed tokens are decoded with their special tokens (a
    BOS comes back as its text, and is read back as the same token), and nothing is added.
    """
    if processed.shape[-1] == 0:
        return tokenizer(text, return_tensors="pt").input_ids
    prior = tokenizer.decode(processed.reshape(-1).tolist(), skip_special_tokens=False,
                             clean_up_tokenization_spaces=False)
    return tokenizer(prior + text, add_special_tokens=False, return_tensors="pt").input_ids


def continue_text(session: Any, tokenizer: Any, text: str, **generate_kwargs: Any) -> str:
    """Generate after the session's history plus ``text``; returns the new text (special tokens skipped).

    ``generate_kwargs`` are ``Session.generate``'s. The history is re-tokenized with the
    new text, so the answer equals a fresh run on the whole text; ``session.last_plan``
    says how much was reused.
    """
    ids = history_ids(tokenizer, session.tokens, text)
    new = session.generate(ids, **generate_kwargs)
    tokens = new if isinstance(new, torch.Tensor) else new.sequences
    return tokenizer.decode(tokens[0], skip_special_tokens=True)
