"""Media placeholder ids a model generated: the next turn with the same pixels is refused with a typed error.

Qwen2-VL and Qwen3-VL (images and videos) and Gemma 3 (images).

``generate`` reads a generated ``<|image_pad|>`` (or ``<|video_pad|>``) as text, but any later forward with
pixels counts it as a media token, and transformers raises an untyped ``ValueError`` ("Image features and
image tokens do not match"), cold and warm alike: no run of such a history is the cold answer. kvstate refuses
it before any forward, with the count, the slots and the fix, and the session's state stays bitwise as it was.
"""

from __future__ import annotations

import pytest
import torch

from kvstate import Session
from kvstate.errors import PlaceholderError
from kvstate.testing.tiny import (
    GEMMA3_IMAGE,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    gemma3_image,
    image_span,
    tiny_image,
    tiny_video,
    video_span,
)
from tiny import assert_same_state, count_forwards, prompt, snapshot, tiny_model

N = 4


def turn(arch: str, kind: str) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """A first turn's history with one image or video, its media inputs, and that kind's placeholder id."""
    if arch == "gemma3":
        span, pixels = gemma3_image(seed=1)
        return torch.cat([prompt(5), span, prompt(4, seed=10)], 1), {"pixel_values": pixels}, GEMMA3_IMAGE
    if kind == "image":
        pixels, grid, n = tiny_image(seed=1)
        span, inputs, token = image_span(n), {"pixel_values": pixels, "image_grid_thw": grid}, IMAGE_TOKEN
    else:
        pixels, grid = tiny_video(seed=2)
        span, inputs, token = video_span(arch, grid), {"pixel_values_videos": pixels, "video_grid_thw": grid}, \
            VIDEO_TOKEN
    return torch.cat([prompt(5), span, prompt(4, seed=10)], 1), inputs, token


def plain(model, ids, inputs):
    """Greedy tokens of plain ``model.generate`` with the token types a processor makes (the oracle)."""
    if model.config.model_type == "gemma3":
        types = {"token_type_ids": (ids == GEMMA3_IMAGE).long()} if inputs else {}
    else:
        types = {"mm_token_type_ids": (ids == IMAGE_TOKEN).int() + 2 * (ids == VIDEO_TOKEN).int()}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                         **types, **inputs)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize(("arch", "kind"), [("qwen2_vl", "image"), ("qwen2_vl", "video"), ("qwen3_vl", "image"),
                                           ("qwen3_vl", "video"), ("gemma3", "image")])
def test_generated_placeholders_are_refused_before_any_forward_and_stripping_them_is_exact(arch, kind):
    model = tiny_model(arch)
    history, inputs, token = turn(arch, kind)
    s = Session(model)
    answer = s.generate(history, max_new_tokens=N, do_sample=False, sequence_bias={(token,): 100.0}, **inputs)
    assert answer.tolist() == [[token] * N]  # the model was made to write placeholders
    following = prompt(3, seed=7)
    nxt = torch.cat([history, answer, following], 1)
    with pytest.raises(ValueError, match=r"features and .* tokens do not match"):  # plain transformers: untyped
        model.generate(nxt, attention_mask=torch.ones_like(nxt), max_new_tokens=N, do_sample=False, **inputs)
    before, plan = snapshot(s.state), s.last_plan
    for session in (s, Session(model)):  # warm and cold
        with count_forwards(model) as calls, pytest.raises(PlaceholderError) as info:
            session.generate(nxt, max_new_tokens=N, do_sample=False, **inputs)
        assert calls[0] == 0
        error = info.value
        slots = list(range(history.shape[1], history.shape[1] + N))
        assert f"{N} {kind} placeholder ids ({token})" in str(error) and str(slots) in error.found
        assert f"suppress_tokens=[{token}]" in error.fix and "strip" in error.fix
    assert_same_state(s.state, before)
    assert s.last_plan is plan
    # the fix: the history without the generated placeholders continues, bit for bit a cold run
    stripped = torch.cat([history, following], 1)
    got = s.generate(stripped, max_new_tokens=N, do_sample=False, **inputs)
    assert torch.equal(got, Session(model).generate(stripped, max_new_tokens=N, do_sample=False, **inputs))
    assert torch.equal(got, plain(model, stripped, inputs))


def test_suppress_tokens_keeps_placeholders_out_and_the_next_turn_runs():
    model = tiny_model("qwen2_vl")
    history, inputs, token = turn("qwen2_vl", "image")
    s = Session(model)
    answer = s.generate(history, max_new_tokens=N, do_sample=False, sequence_bias={(token,): 100.0},
                        suppress_tokens=[token], **inputs)
    assert token not in answer.tolist()[0]
    nxt = torch.cat([history, answer, prompt(3, seed=7)], 1)
    got = s.generate(nxt, max_new_tokens=N, do_sample=False, **inputs)
    assert torch.equal(got, plain(model, nxt, inputs))


def test_extend_with_pixels_refuses_placeholders_outside_the_image():
    model = tiny_model("qwen3_vl")
    pixels, grid, n = tiny_image(seed=1)
    s = Session(model)
    s.extend(prompt(5))
    before = snapshot(s.state)
    stray = torch.tensor([[IMAGE_TOKEN, IMAGE_TOKEN]])
    ids = torch.cat([prompt(2, seed=3), stray, image_span(n), prompt(2, seed=4)], 1)
    with count_forwards(model) as calls, pytest.raises(PlaceholderError, match=r"2 image placeholder ids") as info:
        s.extend(ids, pixel_values=pixels, image_grid_thw=grid)
    assert calls[0] == 0 and "[2, 3]" in info.value.found  # slots of the new ids
    assert_same_state(s.state, before)


def test_without_pixels_placeholder_ids_are_text_as_in_plain_generate():
    model = tiny_model("qwen2_vl")  # a text-only chat in which the model wrote an image placeholder
    ids = torch.cat([prompt(6), torch.tensor([[IMAGE_TOKEN, IMAGE_TOKEN]]), prompt(3, seed=4)], 1)
    got = Session(model).generate(ids, max_new_tokens=N, do_sample=False)
    assert torch.equal(got, plain(model, ids, {}))


def test_the_server_never_reaches_the_refusal_with_a_500():
    """``kvstate serve`` decodes answers without special tokens, so a generated placeholder never comes back in
    the next turn's text, and placeholder text in a message is text (``kvstate.text.chat_ids``), never an image id:
    no history the server builds can hold a stray placeholder."""
    from tests.serving import client, live
    from tests.test_serve_images import _ask

    from kvstate.serve import Server, Settings
    from kvstate.serve.cli import image_processor, load

    model, tokenizer = load("tiny:qwen2_vl")
    server = Server(model, tokenizer, "tiny:qwen2_vl", Settings(canonical_chunk=8),
                    image_processor=image_processor("tiny:qwen2_vl"))
    with live(server) as url:
        api, messages = client(url), [_ask(1, "What is this? ")]
        first = api.chat.completions.create(model="tiny:qwen2_vl", messages=messages, max_tokens=N, temperature=0,
                                            logit_bias={str(IMAGE_TOKEN): 100})
        assert first.usage.completion_tokens == N and first.choices[0].message.content == ""  # N placeholders
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Again?"}]
        second = api.chat.completions.create(model="tiny:qwen2_vl", messages=messages, max_tokens=N, temperature=0)
        assert second.usage.completion_tokens == N
        own = server.render(messages, True)[0].ids.count(IMAGE_TOKEN)  # the image's own placeholders
        messages[1] = {"role": "assistant", "content": "<|image_pad|><|image_pad|>"}  # a client that kept them
        assert server.render(messages, True)[0].ids.count(IMAGE_TOKEN) == own  # message text is text
        third = api.chat.completions.create(model="tiny:qwen2_vl", messages=messages, max_tokens=N, temperature=0)
        assert third.usage.completion_tokens == N
