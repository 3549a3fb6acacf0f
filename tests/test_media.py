"""Media identity: the state records a content hash per processed image, so a history
whose placeholders match but whose pixels differ never continues on stale K/V."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvstate import Session
from kvstate.errors import InputError
from kvstate.resume import media_prefix
from kvstate.state import MediaItem
from kvstate.testing.tiny import QWEN_VL, image_span, tiny_image
from tiny import prompt, tiny_model

N = dict(max_new_tokens=4, do_sample=False)


def images(*seeds):
    """``pixel_values`` and ``image_grid_thw`` of one tiny image per seed, and the placeholders per image."""
    parts = [tiny_image(seed=s) for s in seeds]
    return torch.cat([p for p, _, _ in parts]), torch.cat([g for _, g, _ in parts]), parts[0][2]


def history(n_images: int, n: int) -> torch.Tensor:
    """Text, then ``n_images`` times (an image span of ``n`` placeholders, text)."""
    parts = [prompt(5)]
    for k in range(n_images):
        parts += [image_span(n), prompt(4, seed=10 + k)]
    return torch.cat(parts, 1)


def fresh(model, ids, pixels, grid):
    return Session(model).generate(ids, pixel_values=pixels, image_grid_thw=grid, **N)


@pytest.mark.parametrize("arch", QWEN_VL)
def test_a_swapped_image_rolls_back_before_it(arch):
    model = tiny_model(arch)
    p1, g1, n = images(1)
    p2, g2, _ = images(2)
    ids = history(1, n)
    s = Session(model)
    s.generate(ids, pixel_values=p1, image_grid_thw=g1, **N)
    assert [(m.start, m.end) for m in s.state.media] == [(6, 6 + n)]
    got = s.generate(ids, pixel_values=p2, image_grid_thw=g2, **N)  # same placeholders, another image
    assert s.last_plan.reused <= 6
    assert torch.equal(got, fresh(model, ids, p2, g2))
    assert not torch.equal(got, fresh(model, ids, p1, g1))  # the stale K/V would have answered this


@pytest.mark.parametrize("arch", QWEN_VL)
def test_the_same_image_is_reused_and_a_changed_second_image_keeps_the_first(arch):
    model = tiny_model(arch)
    pixels, grid, n = images(1, 2)
    ids = history(2, n)
    s = Session(model, canonical_chunk=0)  # the media keys of the longest-prefix planner (test_schedule.py)
    s.generate(ids, pixel_values=pixels, image_grid_thw=grid, **N)
    longer = torch.cat([ids, prompt(3, seed=7)], 1)
    s.generate(longer, pixel_values=pixels, image_grid_thw=grid, **N)
    assert s.last_plan.reused == ids.shape[1]  # nothing re-encoded
    other, other_grid, _ = images(1, 3)
    got = s.generate(longer, pixel_values=other, image_grid_thw=other_grid, **N)
    second = 6 + n + 1 + 4 + 1
    assert s.last_plan.reused == second  # the first image's slots stay, the second is re-encoded
    assert torch.equal(got, fresh(model, longer, other, other_grid))


def test_media_records_survive_save_and_load_and_still_guard(tmp_path):
    model = tiny_model("qwen2_vl")
    p1, g1, n = images(1)
    p2, g2, _ = images(2)
    ids = history(1, n)
    s = Session(model)
    s.extend(ids[:, :6])
    s.extend(ids[:, 6:], pixel_values=p1, image_grid_thw=g1)  # extend records the image it fed
    assert s.state.media == (MediaItem(6, 6 + n, s.state.media[0].digest),)
    s.save(tmp_path / "vl.kvs")
    loaded = Session.load(tmp_path / "vl.kvs", tiny_model("qwen2_vl"))
    assert loaded.state.media == s.state.media
    got = loaded.generate(ids, pixel_values=p2, image_grid_thw=g2, **N)
    assert loaded.last_plan.reused <= 6 and torch.equal(got, fresh(model, ids, p2, g2))


def test_a_state_without_media_records_re_encodes_rather_than_trusts():
    """States from files written before media hashes: given pixels, re-feed from the first image."""
    model = tiny_model("qwen3_vl")
    p1, g1, n = images(1)
    ids = history(1, n)
    s = Session(model)
    s.generate(ids, pixel_values=p1, image_grid_thw=g1, **N)
    old = Session(model, state=replace(s.state, media=()))
    got = old.generate(ids, pixel_values=p1, image_grid_thw=g1, **N)
    assert old.last_plan.reused <= 6 and torch.equal(got, fresh(model, ids, p1, g1))
    trusting = Session(model, state=replace(s.state, media=()))
    trusting.generate(ids, **N)  # no pixels: every image is processed, the placeholders are trusted
    assert trusting.last_plan.reused == ids.shape[1] - 1  # only the last token is fed again


def test_pixels_for_only_some_images_name_the_runs():
    model = tiny_model("qwen3_vl")
    pixels, grid, n = images(1, 2)
    ids = history(2, n)
    s = Session(model)
    s.generate(ids[:, :13], pixel_values=pixels[: pixels.shape[0] // 2], image_grid_thw=grid[:1], **N)
    before = s.state
    with pytest.raises(InputError, match=r"pixels for 1 image\(s\) do not cover the 2 image runs") as info:
        s.generate(ids, pixel_values=pixels[pixels.shape[0] // 2:], image_grid_thw=grid[1:], **N)
    assert f"(6, {6 + n})" in str(info.value)
    assert s.state is before


def test_media_prefix_on_toy_states():
    from kvstate.state import State

    state = replace(State.empty((), batch_size=1), tokens=torch.zeros(1, 20, dtype=torch.long),
                    media=(MediaItem(2, 6, "a"), MediaItem(10, 14, "b")))
    assert media_prefix(state, None) == 20
    assert media_prefix(state, [MediaItem(2, 6, "a"), MediaItem(10, 14, "b")]) == 20
    assert media_prefix(state, [MediaItem(2, 6, "a"), MediaItem(10, 14, "c")]) == 10
    assert media_prefix(state, [MediaItem(2, 6, "x"), MediaItem(10, 14, "b")]) == 2
    assert media_prefix(state, [MediaItem(2, 6, "a"), MediaItem(22, 26, "new")]) == 20  # beyond the state


@pytest.mark.parametrize("token", ["image_token_id", "video_token_id"])
def test_a_placeholder_id_outside_a_vision_span_is_text(token):
    """A model can generate a placeholder id; plain ``generate`` marks generated tokens as text, so
    kvstate does too (media runs follow a vision-start token, as processors lay them out)."""
    model = tiny_model("qwen3_vl")
    ids = torch.cat([prompt(5), torch.tensor([[getattr(model.config, token)]]), prompt(4, seed=3)], 1)
    s = Session(model)
    s.extend(ids[:, :3])
    got = s.generate(ids, **N)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=torch.zeros_like(ids), **N)
    assert torch.equal(got, plain[:, ids.shape[1]:])
