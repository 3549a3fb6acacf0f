"""No tensor handed out or taken in shares memory with the state.

Every tensor a caller passes in (ids, masks, positions, pixels) or gets back (logits,
tokens, scores, ``session.tokens``) is overwritten in place after the call; the
state must not change, and continuing must still equal a fresh run.
"""

from __future__ import annotations

import pytest
import torch

from kvstate import Session
from kvstate.testing.tiny import IMAGE_TOKEN, image_span, tiny_image
from tiny import assert_same_state, prompt, snapshot, tiny_model


def scribble(*tensors):
    """Overwrite tensors in place with values no caller would pass."""
    for t in tensors:
        if t is None:
            continue
        if t.dtype == torch.bool:
            t.logical_not_()
        elif t.is_floating_point():
            t.fill_(123.0)
        else:
            t.fill_(1)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_tensors_in_and_out_of_extend_and_generate(arch):
    model = tiny_model(arch)
    ids = prompt(24)
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)[:, 24:]
    s = Session(model)
    first, mask = ids[:, :16].clone(), torch.ones(1, 16, dtype=torch.bool)
    positions = torch.arange(16)[None]
    logits = s.extend(first, attention_mask=mask, position_ids=positions)
    before = snapshot(s.state)
    scribble(first, mask, positions, logits, s.tokens)
    assert_same_state(s.state, before)

    history = ids.clone()
    long_mask = torch.ones(1, 24, dtype=torch.long)
    out = s.generate(history, attention_mask=long_mask, max_new_tokens=6, do_sample=False,
                     return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert torch.equal(out.sequences, reference)
    before = snapshot(s.state)
    scribble(history, long_mask, out.sequences, *out.scores, *out.logits)
    assert_same_state(s.state, before)
    assert getattr(out, "cache", None) is None and getattr(out, "past_key_values", None) is None

    tokens = s.generate(ids, max_new_tokens=6, do_sample=False)  # fully processed: first step from stored logits
    assert torch.equal(tokens, reference)
    before = snapshot(s.state)
    scribble(tokens)
    assert_same_state(s.state, before)
    assert torch.equal(s.generate(ids, max_new_tokens=6, do_sample=False), reference)


def test_image_inputs_are_not_kept():
    model = tiny_model("qwen3_vl")
    pixels, grid, n = tiny_image((4, 6), seed=3)
    history = torch.cat([prompt(6), image_span(n), prompt(9, seed=2)], 1)
    types = (history == IMAGE_TOKEN).int()
    reference = model.generate(history, attention_mask=torch.ones_like(history), pixel_values=pixels,
                               image_grid_thw=grid, mm_token_type_ids=types, max_new_tokens=5, do_sample=False)
    s = Session(model)
    given_pixels, given_grid = pixels.clone(), grid.clone()
    s.extend(history[:, :-3], pixel_values=given_pixels, image_grid_thw=given_grid)
    before = snapshot(s.state)
    scribble(given_pixels, given_grid)
    assert_same_state(s.state, before)
    tokens = s.generate(history, max_new_tokens=5, do_sample=False, pixel_values=pixels, image_grid_thw=grid)
    assert torch.equal(tokens, reference[:, history.shape[1]:])


def test_forks_and_clones_share_nothing_that_can_change():
    model = tiny_model("llama")
    s = Session(model)
    s.extend(prompt(20))
    fork, copy = s.fork(), s.state.clone()
    s.extend(prompt(4, seed=3))
    assert_same_state(fork.state, copy)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(
        [t for layer in copy.layers for t in layer.tensors().values()],
        [t for layer in fork.state.layers for t in layer.tensors().values()], strict=True))
