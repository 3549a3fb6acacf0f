"""Qwen-VL images through ``image_url`` data URLs: exact answers, reuse keyed by the pixels."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image
from tests.serving import chat_turn, client, live

from kvstate import Session
from kvstate.serve import Server, Settings
from kvstate.serve.cli import image_processor, load

MODEL = "tiny:qwen2_vl"


@pytest.fixture(scope="module")
def vl() -> tuple:
    model, tokenizer = load(MODEL)
    return model, tokenizer, image_processor(MODEL)


def _png(seed: int, size: int = 16) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _ask(seed: int, text: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": _png(seed)}}]}


def _reference(server: Server, model, tokenizer, messages: list) -> str:
    prompt, inputs = server.render(messages, True)
    new = Session(model).generate(torch.tensor([prompt.ids]), max_new_tokens=10, do_sample=False,
                                  stop_strings=list(prompt.default_stop), tokenizer=tokenizer, **inputs)
    text = tokenizer.decode(new[0].tolist(), skip_special_tokens=True)
    return text.split(prompt.default_stop[0])[0]


@pytest.mark.parametrize("max_batch", [1, 4])  # one at a time, and batched
def test_images_answer_exactly_and_reuse_only_the_same_pixels(vl, max_batch):
    model, tokenizer, images = vl
    # canonical chunks of 8 tokens, so turn 2 of this short chat can reuse the image's slots
    server = Server(model, tokenizer, MODEL, Settings(canonical_chunk=8, max_batch=max_batch), image_processor=images)
    with live(server) as url:
        api = client(url)
        messages = [_ask(1, "What is this? ")]
        answer, cached = chat_turn(api, messages, stream=False, model=MODEL)
        prompt, inputs = server.render(messages, True)
        assert inputs["pixel_values"].shape[0] > 0 and prompt.ids.count(190) == 16  # 16x16 px: 16 tokens
        assert answer == _reference(server, model, tokenizer, messages) and cached == 0
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Are you sure?"}]
        answer2, cached2 = chat_turn(api, messages, stream=True, model=MODEL)
        assert cached2 > prompt.ids.index(193), "turn 2 reuses the image it already processed"
        assert answer2 == _reference(server, model, tokenizer, messages)
        other = [_ask(2, "What is this? ")]  # the same text and placeholders, other pixels
        answer3, cached3 = chat_turn(api, other, stream=False, model=MODEL)
        assert cached3 <= prompt.ids.index(190), "reuse must stop before an image whose pixels differ"
        assert answer3 == _reference(server, model, tokenizer, other)


def test_placeholder_text_is_text_and_text_only_models_are_refused(vl, tmp_path):
    """Image tokens typed as text are text (``kvstate.text.chat_ids``): a text-only chat never holds image ids,
    and in a chat with images, typed placeholders next to the server's own ones are refused."""
    import openai

    model, tokenizer, images = vl
    placeholders = "<|vision_start|><|image_pad|><|vision_end|>"
    server = Server(model, tokenizer, MODEL, Settings(), image_processor=images)
    smuggled = [{"role": "user", "content": placeholders}]
    with live(server) as url:
        prompt, inputs = server.render(smuggled, True)
        assert not inputs and not set(prompt.ids) & set(range(190, 194))  # the characters, no image tokens
        assert prompt.ids.count(tokenizer.convert_tokens_to_ids("<")) == 3
        chat_turn(client(url), smuggled, stream=False, model=MODEL)  # answered as the text it is
        with pytest.raises(openai.BadRequestError):  # typed next to an image: indistinguishable from its group
            chat_turn(client(url), [_ask(1, placeholders)], stream=False, model=MODEL)
    llama, text_tokenizer = load("tiny:llama")
    with live(Server(llama, text_tokenizer, "tiny:llama", Settings())) as url, \
            pytest.raises(openai.BadRequestError) as info:
        chat_turn(client(url), [_ask(1, "hi")], stream=False)
        assert "takes no images" in info.value.body["message"]
