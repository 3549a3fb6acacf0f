"""Gemma 3 with images: image tokens attend bidirectionally within their image.

Checked against plain ``model.generate`` with the processor's ``token_type_ids``: a split
before the image, a resume on a fresh instance from a file, a swapped image, a divergence
inside the image, and the mask's effect itself (without the bidirectional block the logits
move, so the test would see a mask that went missing)."""

from __future__ import annotations

import pytest
import torch

from kvstate import Session
from kvstate.errors import InputError
from kvstate.testing.tiny import GEMMA3_IMAGE, gemma3_image
from tiny import assert_logits_close, prompt, tiny_model

N = 6


def history(seed=0):
    span, pixels = gemma3_image(seed)
    return torch.cat([prompt(5), span, prompt(4, seed=2)], 1), pixels


def plain(model, ids, pixels, n=N):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                         token_type_ids=(ids == GEMMA3_IMAGE).long(), max_new_tokens=n, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences[:, ids.shape[1]:], out.logits[0]


def greedy(session, ids, n=N, **inputs):
    out = session.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                           output_logits=True, **inputs)
    return out.sequences, out.logits[0]


def test_an_image_fed_after_a_text_prefix_equals_a_full_prefill():
    model = tiny_model("gemma3")
    ids, pixels = history()
    s = Session(model)
    s.extend(ids[:, :3])
    tokens, logits = greedy(s, ids, pixel_values=pixels)
    ref_tokens, ref_logits = plain(model, ids, pixels)
    assert torch.equal(tokens, ref_tokens)
    assert_logits_close(logits, ref_logits, "image after a text prefix")
    with torch.no_grad():  # the block mask matters here: without token types the logits move
        causal = model(ids, pixel_values=pixels).logits[:, -1]
        full = model(ids, pixel_values=pixels, token_type_ids=(ids == GEMMA3_IMAGE).long()).logits[:, -1]
    assert (causal - full).abs().max() > 1e-4


def test_an_image_state_resumes_from_a_file_on_a_fresh_instance(tmp_path):
    model = tiny_model("gemma3")
    ids, pixels = history()
    s = Session(model)
    s.extend(ids, pixel_values=pixels)
    s.save(tmp_path / "g.kvs")
    longer = torch.cat([ids, prompt(4, seed=7)], 1)
    loaded = Session.load(tmp_path / "g.kvs", tiny_model("gemma3"))
    fork = s.fork()
    tokens, logits = greedy(loaded, longer)  # the image is processed: no pixels needed
    ref_tokens, ref_logits = plain(model, longer, pixels)
    assert loaded.last_plan.reused == ids.shape[1]
    assert torch.equal(tokens, ref_tokens)
    assert_logits_close(logits, ref_logits, "fresh instance")
    other = torch.cat([ids, prompt(3, seed=11)], 1)
    assert torch.equal(greedy(fork, other)[0], plain(model, other, pixels)[0])  # a fork, on another branch
    assert torch.equal(greedy(s, longer)[0], ref_tokens)  # the original, untouched by its fork


def test_a_swapped_image_and_a_divergence_inside_an_image_roll_back_before_it():
    model = tiny_model("gemma3")
    ids, pixels = history()
    _, other = gemma3_image(seed=5)
    s = Session(model)
    greedy(s, ids, pixel_values=pixels)
    (item,) = s.state.media
    tokens, _ = greedy(s, ids, pixel_values=other)
    assert s.last_plan.reused <= item.start
    assert torch.equal(tokens, plain(model, ids, other)[0])
    before = s.state
    cut = torch.cat([ids[:, :item.start + 2], prompt(3, seed=8)], 1)  # the history leaves mid-image
    with pytest.raises(InputError, match="without their pixels"):  # a half image is a new, unprocessed one
        s.generate(cut, max_new_tokens=2, do_sample=False)
    assert s.state is before
    longer = torch.cat([ids, prompt(3, seed=9)], 1)
    s.truncate(item.start + 2)  # a rollback into the image
    tokens, _ = greedy(s, longer, pixel_values=other)
    assert s.last_plan.reused <= item.start  # the image is fed again whole
    assert torch.equal(tokens, plain(model, longer, other)[0])
