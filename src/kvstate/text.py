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

from .errors import InputError


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
    says how much was reused. The answer's last token is then processed too (one decode
    step the next turn would run anyway), so the session's tokens hold every token of the
    answer: the next turn's history is the whole conversation. A final special token (the
    EOS that ended the answer) is left out, as the answer's text leaves it out.
    """
    from .session import Session

    if not isinstance(text, str):
        raise InputError("continue_text takes text", expected="str", found=type(text).__name__,
                         fix="pass a str (decode bytes first: data.decode('utf-8'))")
    if not isinstance(session, Session) or not callable(tokenizer):
        raise InputError("continue_text takes a Session and its model's tokenizer",
                         expected="continue_text(session, tokenizer, text)",
                         found=f"{type(session).__name__}, {type(tokenizer).__name__}",
                         fix="pass kvstate.Session(model) and AutoTokenizer.from_pretrained(...)")
    ids = history_ids(tokenizer, session.tokens, text)
    new = session.generate(ids, **generate_kwargs)
    tokens = new if isinstance(new, torch.Tensor) else new.sequences
    last = tokens[:, -1:]
    unprocessed = session.state.tokens_seen < ids.shape[1] + tokens.shape[1]
    if unprocessed and last.numel() == 1 and int(last) not in set(tokenizer.all_special_ids):
        session.extend(last)
    return tokenizer.decode(tokens[0], skip_special_tokens=True)


def turn_marks(tokenizer: Any, template: str | None = None) -> tuple[int, ...]:
    """The token ids a chat ``template`` (default: the tokenizer's) writes before each later user
    message, for ``Session(canonical_marks=...)`` (``kvstate.schedule``). Found by rendering a chat with
    an answer, then with one more user message of two different contents: the ids they share after the
    answer. ``()`` when the template does not continue its text that way (a later message changes
    how the earlier text tokenizes), so the schedule falls back to cuts at multiples of ``C``."""
    def ids(messages: list[dict[str, str]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    chat = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi"}]
    base = ids(chat)
    one, two = (ids([*chat, {"role": "user", "content": word}]) for word in ("alpha", "omega"))
    if one[:len(base)] != base or two[:len(base)] != base:
        return ()
    marks = []
    for a, b in zip(one[len(base):], two[len(base):], strict=False):
        if a != b:
            break
        marks.append(a)
    return tuple(marks[:64])
