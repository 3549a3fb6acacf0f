"""Requests to token ids: chat messages through a chat template, prompts as text.

A model whose tokenizer has no chat template (the default Gemma-3-270M GGUF, the
tiny models) gets ``FALLBACK_TEMPLATE``, a plain transcript::

    <bos>{system}\\n\\n            (only with a system message)
    User: {content}\\n
    Assistant:{content}\\n         (the content as the server returned it, leading space included)
    Assistant:                     (the generation prompt)

with ``"\\nUser:"`` as its default stop sequence. The assistant content follows the
colon with nothing added, so the text an answer was generated as is the text the
next turn renders: the next request's tokens then continue the stored state.
Templates render text, which is tokenized without adding special tokens (the
template writes its own BOS), as ``transformers serve`` does, by ``kvstate.text.chat_ids``:
message contents are text, never control tokens (a user's ``"<eos>"`` is those five
characters), and the template's own special tokens stay special.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from .errors import BadRequest

FALLBACK_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant:{{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
FALLBACK_STOP = ("\nUser:",)
ROLES = ("system", "developer", "user", "assistant")
IMAGE_MIME = ("image/png", "image/jpeg", "image/webp", "image/gif")
MAX_IMAGE_PIXELS = 40_000_000


@dataclass(frozen=True)
class Prompt:
    """A rendered request: ``text`` and its ``ids`` (a list of ints), the decoded ``images``
    (PIL images, in order) and ``default_stop``, the template's stop sequences."""

    text: str
    ids: list[int]
    images: tuple[Any, ...] = ()
    image_digests: tuple[str, ...] = ()
    default_stop: tuple[str, ...] = ()
    messages: tuple[dict[str, str], ...] = ()  # a text-only chat's rendered messages (``Renderer.following``)
    plain: bool = False  # a completions prompt given as text: its continuation is its text plus more


class Renderer:
    """Renders chat messages and prompts for one tokenizer (for image models, with its image placeholder)."""

    def __init__(self, tokenizer: Any, *, image_placeholder: str | None = None, max_image_bytes: int = 8 << 20,
                 vocab: int | None = None) -> None:
        self.tokenizer, self.vocab = tokenizer, vocab
        self.template = getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE
        self.default_stop = FALLBACK_STOP if self.template is FALLBACK_TEMPLATE else ()
        self.image_placeholder = image_placeholder
        self.max_image_bytes = max_image_bytes

    def chat(self, messages: Any) -> Prompt:
        """``messages``: the OpenAI list of ``{"role", "content"}``; content a string or a list of parts."""
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array", param="messages")
        images: list[Any] = []
        digests: list[str] = []
        plain = [self._message(i, m, images, digests) for i, m in enumerate(messages)]
        text = self.tokenizer.apply_chat_template(plain, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=True)
        keep = (self.image_placeholder,) if images and self.image_placeholder else ()  # the server's own groups
        return Prompt(text, self._ids(plain, True, keep), tuple(images), tuple(digests), self.default_stop,
                      () if images else tuple(plain))

    @functools.cached_property
    def marks(self) -> tuple[int, ...]:
        """The ids the template writes before a later user message: the canonical schedule's turn marks."""
        from ..text import turn_marks

        try:
            return turn_marks(self.tokenizer, self.template)
        except Exception:  # a template that refuses the probe chat: cuts at multiples of C only, still exact
            logging.getLogger("kvstate.serve").warning("no turn marks: the chat template failed to render a "
                                                       "probe chat", exc_info=True)
            return ()

    def following(self, prompt: Prompt, answer: str) -> list[int] | None:
        """The ids the next turn's history begins with after ``answer`` to ``prompt``: a text-only chat's
        messages plus the answer, rendered without a generation prompt; a text completion's prompt plus the
        answer, tokenized as one string (a client that continues it sends that text and more). None for
        other prompts."""
        if prompt.plain:
            return list(self.tokenizer(prompt.text + answer).input_ids)
        if not prompt.messages:
            return None
        plain = [*prompt.messages, {"role": "assistant", "content": answer}]
        return self._ids(plain, False)

    def completion(self, prompt: Any) -> Prompt:
        """``prompt``: a string (tokenized with the tokenizer's special tokens, as a fresh run would) or a
        list of token ids."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # OpenAI accepts a batch; n=1 and one prompt are what kvstate serves
        if isinstance(prompt, str) and prompt:
            return Prompt(prompt, self.tokenizer(prompt).input_ids, plain=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            if self.vocab is not None and not all(0 <= t < self.vocab for t in prompt):
                # before decoding: the tokenizer overflows on ids past its table
                raise BadRequest(f"token ids must be in [0, {self.vocab})", param="prompt", code="invalid_value")
            return Prompt(self.tokenizer.decode(prompt), list(prompt))
        raise BadRequest("'prompt' must be one non-empty string or one non-empty array of token ids",
                         param="prompt")

    def _ids(self, messages: list[dict[str, str]], prompt: bool, keep: tuple[str, ...] = ()) -> list[int]:
        """``kvstate.text.chat_ids``: contents are text, the template's special tokens stay special."""
        from ..errors import InputError
        from ..text import chat_ids

        try:
            return chat_ids(self.tokenizer, messages, self.template, add_generation_prompt=prompt, keep=keep)
        except InputError as exc:
            raise BadRequest(str(exc), param="messages") from exc

    def _message(self, index: int, message: Any, images: list[Any], digests: list[str]) -> dict[str, str]:
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRequest(f"messages[{index}] needs a 'role' among {', '.join(ROLES)}",
                             param=f"messages[{index}].role")
        role = "system" if message["role"] == "developer" else message["role"]
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, str):
            return {"role": role, "content": content}
        if not isinstance(content, list):
            raise BadRequest(f"messages[{index}].content must be a string or an array of parts",
                             param=f"messages[{index}].content")
        return {"role": role, "content": "".join(self._part(index, p, images, digests) for p in content)}

    def _part(self, index: int, part: Any, images: list[Any], digests: list[str]) -> str:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            return part["text"]
        if kind == "image_url":
            url = part.get("image_url", {}).get("url") if isinstance(part.get("image_url"), dict) else None
            image, digest = self._image(index, url)
            images.append(image)
            digests.append(digest)
            return self.image_placeholder or ""
        raise BadRequest(f"messages[{index}].content has an unsupported part {kind!r}",
                         param=f"messages[{index}].content", fix="use parts of type 'text' or 'image_url'")

    def _image(self, index: int, url: Any) -> tuple[Any, str]:
        """A data-URL image, decoded in memory: kvstate never fetches a URL or opens a path a request names."""
        param = f"messages[{index}].content.image_url"
        if self.image_placeholder is None:
            raise BadRequest("this model takes no images", param=param, fix="send text parts only")
        if not isinstance(url, str) or not url.startswith("data:"):
            raise BadRequest("images must be data URLs (data:image/png;base64,...); the server fetches no URL "
                             "and opens no path", param=param)
        header, _, payload = url.partition(",")
        mime = header[5:].split(";")[0]
        if mime not in IMAGE_MIME or not header.endswith(";base64"):
            raise BadRequest(f"unsupported image data URL header {header[:40]!r}", param=param,
                             fix=f"send base64 data of one of {', '.join(IMAGE_MIME)}")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise BadRequest("the image data URL is not valid base64", param=param) from exc
        if len(data) > self.max_image_bytes:
            raise BadRequest(f"image of {len(data)} bytes is over the limit of {self.max_image_bytes}", param=param,
                             status=413)
        return _decode_image(data, param), hashlib.sha256(data).hexdigest()


def _decode_image(data: bytes, param: str) -> Any:
    import io

    from PIL import Image, UnidentifiedImageError

    too_large = BadRequest(f"image dimensions are over the limit of {MAX_IMAGE_PIXELS} pixels", param=param,
                           status=413)
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_IMAGE_PIXELS:  # a decompression bomb: refuse before decoding pixels
            raise too_large
        return image.convert("RGB")
    except BadRequest:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's own refusal at open(), past twice its pixel limit
        raise too_large from exc
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise BadRequest(f"cannot decode the image: {str(exc)[:200]}", param=param) from exc
    except Exception as exc:  # a malformed file can raise anything from a decoder (SyntaxError, struct.error)
        raise BadRequest("cannot decode the image: the data is malformed", param=param) from exc
