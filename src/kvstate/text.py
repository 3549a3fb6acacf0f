"""Continuing a state with more *text*, exactly as a fresh run on the whole text would.

Tokenizing new text on its own and appending its ids changes the answer: tokens can
merge across the boundary ("doc" + "ument" is not "document"), and a fresh run never
sees a second BOS. ``history_ids`` therefore re-tokenizes the processed tokens' text
plus the new text as one string, and ``Session.generate`` resumes from the longest
common token prefix. The answer is then the fresh run's.

``chat_ids`` turns chat messages into ids under one rule, which ``kvstate serve`` applies too: a
message's content is text, never control tokens (its ``"<bos>"`` is five characters, not the BOS);
the template's own special tokens stay special.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping, Sequence
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
    _check_text_only(generate_kwargs)
    ids = history_ids(tokenizer, session.tokens, text)
    new = session.generate(ids, **generate_kwargs)
    tokens = new if isinstance(new, torch.Tensor) else new.sequences
    last = tokens[:, -1:]
    unprocessed = session.state.tokens_seen < ids.shape[1] + tokens.shape[1]
    if unprocessed and last.numel() == 1 and int(last) not in set(tokenizer.all_special_ids):
        session.extend(last)
    return tokenizer.decode(tokens[0], skip_special_tokens=True)


# options whose only effect is on generate's output object, which continue_text does not return
_OUTPUT_OPTIONS = ("return_dict_in_generate", "output_scores", "output_logits")


def _check_text_only(options: Mapping[str, Any]) -> None:
    """Refuse options that ask for more than the text (scores, logits, the output object): ``continue_text`` would
    drop them without a word."""
    config = options.get("generation_config")
    asked = [name for name in _OUTPUT_OPTIONS if options.get(name) or getattr(config, name, False)]
    if asked:
        raise InputError("continue_text returns the answer's text only", found=", ".join(asked),
                         fix="call session.generate(kvstate.text.history_ids(tokenizer, session.tokens, text), ...) "
                         "for generate's output object, or drop these options")


def turn_marks(tokenizer: Any, template: str | None = None) -> tuple[int, ...]:
    """The token ids a chat ``template`` (default: the tokenizer's) writes before each later user
    message, for ``Session(canonical_marks=...)`` (``kvstate.schedule``). Found by rendering a chat with
    an answer, then with one more user message of two different contents: the ids they share after the
    answer. ``()`` when the template does not continue its text that way (a later message changes
    how the earlier text tokenizes), so the schedule falls back to cuts at multiples of ``C``."""
    def ids(messages: list[dict[str, str]]) -> list[int]:
        return chat_ids(tokenizer, messages, template, add_generation_prompt=False)

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


_BREAKS = ("\n", "\r", "\u010a", "\u010d", "<0x0A>", "<0x0D>")  # a line break as vocabularies spell it


def line_marks(tokenizer: Any) -> tuple[int, ...]:
    """Line marks for ``Session(canonical_marks=...)`` (``kvstate.schedule.lines``): every token whose text begins
    with a line break, so text without a chat template (a raw completions prompt) is cut where its lines
    start. ``()`` when no token does. Special tokens are never among them."""
    from .schedule import MAX_LINE_TOKENS, lines

    specials = set(tokenizer.all_special_ids)
    candidates = sorted(i for token, i in tokenizer.get_vocab().items()
                        if i not in specials and any(b in token for b in _BREAKS))
    found = [i for i in candidates if tokenizer.decode([i]).startswith(("\n", "\r"))][:MAX_LINE_TOKENS]
    return lines(found) if found else ()


class PromptMarks:
    """Prompt marks (``kvstate.schedule.prompt``) for the raw prompts of one ``tokenizer``: ``marks(ids)`` are a
    prompt's, for ``Session(canonical_marks=...)``. Their label is the prompt's last line when that line is a
    label: at most ``MAX_LABEL`` tokens after a line start, trailing whitespace included, whose text ends with
    ``":"`` (``"A:"``, ``"Answer:"``, ``"### Response:\\n"``) or that begins with a special token (a chat
    template's role header, rendered by the client). A conversation that ends every prompt with that line then
    finds each earlier prompt's end on a cut. Any other prompt gets no label (text to continue, code): its last
    line changes from prompt to prompt, and other marks would share no slot. ``()`` when no token starts a line.
    ``gap``: the line gap (``kvstate.schedule.default_gap``)."""

    def __init__(self, tokenizer: Any, gap: int) -> None:
        found = line_marks(tokenizer)
        self.tokenizer, self.gap, self.breaks = tokenizer, gap, found[1:]
        self._starts = frozenset(self.breaks)
        self._specials = frozenset(tokenizer.all_special_ids)

    def __call__(self, ids: Sequence[int]) -> tuple[int, ...]:
        from .schedule import prompt

        return prompt(self.breaks, self.label(ids), self.gap) if self.breaks else ()

    def label(self, ids: Sequence[int]) -> tuple[int, ...]:
        """The label of the prompt ``ids``: its last line's tokens after the line start, or ``()``."""
        from .schedule import MAX_LABEL

        tail = [int(t) for t in ids[-(MAX_LABEL + 1):]]
        end = len(tail)
        while end and not self.tokenizer.decode([tail[end - 1]]).strip():
            end -= 1  # trailing whitespace (a line break after "### Response:") belongs to the label
        start = max((i for i in range(end) if tail[i] in self._starts), default=-1)
        content = tail[start + 1:end]
        if start < 0 or not content:
            return ()
        text = self.tokenizer.decode(content, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        labelled = text.rstrip().endswith(":") or content[0] in self._specials
        return tuple(tail[start + 1:]) if labelled else ()


# ----- chat messages to ids -------------------------------------------------------------------------
# Private-use characters: no tokenizer gives them a special meaning and no template transforms them
_MARKER = re.compile("\ue000(\\d+)\ue001")
_CONTROLS: weakref.WeakKeyDictionary[object, frozenset[int]] = weakref.WeakKeyDictionary()


def chat_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]], template: str | None = None, *,
             add_generation_prompt: bool = True, keep: Sequence[str] = ()) -> list[int]:
    """Token ids of a chat: ``messages`` (``{"role", "content"}``, content a string) rendered with ``template``
    (default: the tokenizer's) and tokenized without added special tokens (the template writes its own BOS).

    **A message's content is text, never control tokens.** Text in a content that spells a special token
    (``"<bos>"``, ``"<end_of_turn>"``, ``"<|im_start|>"``) is tokenized as the characters it is, so no message
    can end its turn, open another role or repeat the BOS; the special tokens the template writes stay special.
    A chat whose contents spell none is tokenized as one string, as ``tokenizer(text)`` does. ``keep``: strings
    that stay special inside contents (the media placeholders a caller put there itself, such as
    ``kvstate serve``'s image groups). ``kvstate serve`` renders every chat with this function, so a chat sent
    to it and the same messages given to ``Session.generate`` through it are the same ids.

    Raises ``InputError`` when a content spells a special token and the template transforms contents (anything
    but inserting them as they are or trimmed), or the tokenizer cannot map ids to text offsets: then no rule
    can tell the template's special tokens from the content's.
    """
    text = tokenizer.apply_chat_template(list(messages), chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    controls = _control_ids(tokenizer)
    contents = [_kept_out(m.get("content"), keep) for m in messages]
    spelled = [c for c in contents if c and not controls.isdisjoint(tokenizer(c, add_special_tokens=False).input_ids)]
    if not spelled:
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    spans = _content_spans(tokenizer, messages, template, add_generation_prompt, text)
    return _as_text(tokenizer, text, spans, keep, controls)


def _control_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (its added tokens marked special), computed once per tokenizer."""
    found = _CONTROLS.get(tokenizer)
    if found is None:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        found = frozenset({i for i, token in added.items() if getattr(token, "special", False)}
                          | set(tokenizer.all_special_ids))
        _CONTROLS[tokenizer] = found
    return found


def _kept_out(content: Any, keep: Sequence[str]) -> str:
    """``content`` without the ``keep`` strings (those stay special); "" for a content that is not a string."""
    if not isinstance(content, str):
        return ""
    for placeholder in keep:
        content = content.replace(placeholder, "")
    return content


def _content_spans(tokenizer: Any, messages: Sequence[Mapping[str, Any]], template: str | None,
                   add_generation_prompt: bool, text: str) -> list[tuple[int, int]]:
    """Where each message's content lies in the rendered ``text``: the chat is rendered again with a marker for
    each content, and ``text`` must be that rendering with the contents put in (as they are, or trimmed)."""
    marked = [{**m, "content": f"\ue000{i}\ue001"} if isinstance(m.get("content"), str) and m["content"] else dict(m)
              for i, m in enumerate(messages)]
    skeleton = tokenizer.apply_chat_template(marked, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    pieces = _MARKER.split(skeleton)  # template text, marker index, template text, ...
    spans, at = [], 0
    for k in range(0, len(pieces) - 1, 2):
        content, after = messages[int(pieces[k + 1])]["content"], pieces[k + 2]
        at = _expect(text, pieces[k], at)
        for candidate in dict.fromkeys((content, content.strip())):
            if text.startswith(candidate, at) and text.startswith(after, at + len(candidate)):
                spans.append((at, at + len(candidate)))
                at += len(candidate)
                break
        else:
            raise _untraceable("the chat template transforms message contents")
    _expect(text, pieces[-1], at)
    return spans


def _expect(text: str, piece: str, at: int) -> int:
    if not text.startswith(piece, at):
        raise _untraceable("the chat template renders other text around contents that spell special tokens")
    return at + len(piece)


def _untraceable(why: str) -> InputError:
    return InputError(f"a message spells a special token, and {why}, so its text cannot be kept apart from the "
                      "template's special tokens", expected="contents inserted as they are (or trimmed)",
                      found=why, fix="remove the special-token text from the messages")


def _as_text(tokenizer: Any, text: str, spans: list[tuple[int, int]], keep: Sequence[str],
             controls: frozenset[int]) -> list[int]:
    """Ids of ``text`` in which the special tokens inside ``spans`` (but the ``keep`` strings) are text: the text
    between the special tokens that stay is tokenized with ``split_special_tokens``, as the tokenizer tokenizes
    the text between special tokens."""
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError) as exc:  # a Python tokenizer: no offsets
        raise _untraceable("the tokenizer gives no text offsets") from exc
    kept = [(a, a + len(s)) for s in keep if s for a0, b0 in spans for a in _finds(text, s, a0, b0)]
    ids: list[int] = []
    begin = 0
    for token, (a, b) in zip(encoded.input_ids, encoded.offset_mapping, strict=True):
        if token not in controls:
            continue
        if any(s <= a < e for s, e in spans) and not any(s <= a < e for s, e in kept):
            continue  # the content's: part of the text around it
        ids += tokenizer(text[begin:a], add_special_tokens=False, split_special_tokens=True).input_ids if a > begin \
            else []
        ids.append(token)
        begin = b
    if begin < len(text):
        ids += tokenizer(text[begin:], add_special_tokens=False, split_special_tokens=True).input_ids
    return list(ids)


def _finds(text: str, piece: str, start: int, end: int) -> list[int]:
    """Starts of the occurrences of ``piece`` within ``text[start:end]``."""
    found, at = [], text.find(piece, start, end)
    while at >= 0:
        found.append(at)
        at = text.find(piece, at + len(piece), end)
    return found
