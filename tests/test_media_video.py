"""Video for Qwen2-VL, Qwen2.5-VL and Qwen3-VL (the long seed's own modality).

Each is checked against a fresh full run of plain ``model.generate`` (with
``mm_token_type_ids``, as the processor makes them): a video prefix saved, loaded into a fresh
instance in another process and continued; ``Session.generate`` with the full history; an
image, then a video, then a second video after a resume; and a swapped video."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import children
from kvstate import Session
from kvstate.testing.tiny import QWEN_VL, image_span, tiny_image, tiny_video, video_span
from tiny import assert_logits_close, prompt, tiny_model

N = 6


def video_inputs(arch, *videos):
    """Model inputs of the given ``(pixels, grid)`` videos (Qwen2.5-VL also takes seconds per grid)."""
    out = {"pixel_values_videos": torch.cat([p for p, _ in videos]),
           "video_grid_thw": torch.cat([g for _, g in videos])}
    if arch == "qwen2_5_vl":
        out["second_per_grid_ts"] = torch.tensor([1.0] * len(videos))
    return out


def plain(model, ids, inputs, n=N):
    """A fresh full run, as ``model.generate`` with the processor's ``mm_token_type_ids``."""
    types = (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         mm_token_type_ids=types, return_dict_in_generate=True, output_logits=True, **inputs)
    return out.sequences[:, ids.shape[1]:], out.logits[0]


def greedy(session, ids, inputs, n=N):
    out = session.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                           output_logits=True, **inputs)
    return out.sequences, out.logits[0]


CHILD = r"""
import sys, torch
from safetensors.torch import save_file
from kvstate import Session
from kvstate.testing.tiny import tiny_model, tiny_prompt
folder, archs = sys.argv[1], sys.argv[2:]
out = {}
for arch in archs:
    s = Session.load(f"{folder}/{arch}.kvs", tiny_model(arch))  # fresh instance, new process
    ids = torch.cat([s.tokens, tiny_prompt(5, seed=77)], 1)  # the video is processed: no pixels needed
    o = s.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    out[f"{arch}.tokens"], out[f"{arch}.logits"] = o.sequences.contiguous(), o.logits[0].contiguous()
save_file(out, f"{folder}/child.safetensors")
"""


def test_a_video_prefix_resumes_in_another_process_on_a_fresh_instance(tmp_path):
    expected = {}
    for arch in QWEN_VL:
        model = tiny_model(arch)
        video = tiny_video(seed=1)
        ids = torch.cat([prompt(5), video_span(arch, video[1]), prompt(4, seed=3)], 1)
        s = Session(model)
        s.extend(ids, **video_inputs(arch, video))
        s.save(tmp_path / f"{arch}.kvs")
        longer = torch.cat([ids, prompt(5, seed=77)], 1)
        expected[arch] = plain(model, longer, video_inputs(arch, video))
    children.run(CHILD, str(tmp_path), *QWEN_VL)  # another process
    with safe_open(str(tmp_path / "child.safetensors"), "pt") as f:
        for arch in QWEN_VL:
            assert torch.equal(f.get_tensor(f"{arch}.tokens"), expected[arch][0]), arch
            assert_logits_close(f.get_tensor(f"{arch}.logits"), expected[arch][1], arch)


@pytest.mark.parametrize("arch", QWEN_VL)
def test_generate_over_image_video_and_a_second_video_after_a_resume(arch):
    model = tiny_model(arch)
    pixels, grid, n = tiny_image(seed=1)
    first, second = tiny_video(seed=2), tiny_video(frames=1, grid_hw=(4, 6), seed=3)
    ids = torch.cat([prompt(5), image_span(n), prompt(3, seed=4), video_span(arch, first[1]), prompt(4, seed=5)], 1)
    media = {"pixel_values": pixels, "image_grid_thw": grid, **video_inputs(arch, first)}
    s = Session(model, canonical_chunk=0)  # the media keys of the longest-prefix planner (test_schedule.py)
    tokens, logits = greedy(s, ids, media)
    ref_tokens, ref_logits = plain(model, ids, media)
    assert torch.equal(tokens, ref_tokens)
    assert_logits_close(logits, ref_logits, "image + video")
    longer = torch.cat([ids, tokens, prompt(3, seed=6), video_span(arch, second[1], seed=40), prompt(2, seed=7)], 1)
    media = {"pixel_values": pixels, "image_grid_thw": grid, **video_inputs(arch, first, second)}
    tokens, logits = greedy(s, longer, media)
    assert s.last_plan.reused >= ids.shape[1]  # neither the image nor the first video is encoded again
    ref_tokens, ref_logits = plain(model, longer, media)
    assert torch.equal(tokens, ref_tokens)
    assert_logits_close(logits, ref_logits, "second video after a resume")


@pytest.mark.parametrize("arch", QWEN_VL)
def test_a_swapped_video_rolls_back_before_it(arch):
    model = tiny_model(arch)
    one, other = tiny_video(seed=1), tiny_video(seed=2)
    ids = torch.cat([prompt(5), video_span(arch, one[1]), prompt(4, seed=3)], 1)
    s = Session(model)
    greedy(s, ids, video_inputs(arch, one))
    assert len(s.state.media) == 1 and s.state.media[0].digest.startswith("video:")
    start = s.state.media[0].start  # the first placeholder of the video
    tokens, _ = greedy(s, ids, video_inputs(arch, other))
    assert s.last_plan.reused <= start
    assert torch.equal(tokens, plain(model, ids, video_inputs(arch, other))[0])


def test_a_resume_never_splits_a_video_between_its_frames():
    """Qwen3-VL puts each frame in its own run, after timestamp text: a history that diverges in
    the second frame's timestamp goes back to before the whole video."""
    arch = "qwen3_vl"
    model = tiny_model(arch)
    video = tiny_video(frames=3, seed=1)
    span = video_span(arch, video[1])
    ids = torch.cat([prompt(5), span, prompt(4, seed=3)], 1)
    s = Session(model)
    greedy(s, ids, video_inputs(arch, video))
    (item,) = s.state.media
    assert item.end - item.start > span.shape[1] // 3 * 2  # one item over the three frame runs
    changed = ids.clone()
    changed[0, 5 + span.shape[1] // 3] += 1  # a timestamp token of the second frame
    tokens, _ = greedy(s, changed, video_inputs(arch, video))
    assert s.last_plan.reused <= item.start
    assert torch.equal(tokens, plain(model, changed, video_inputs(arch, video))[0])
