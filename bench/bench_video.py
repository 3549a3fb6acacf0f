"""Video prefix: time to the first token of a follow-up question, Qwen3-VL, CPU.

A random Qwen3-VL, larger than the test suite's tiny one (text: hidden 256, 4 layers; vision:
depth 2, hidden 128), watches a video of 16 temporal patches of 24 x 24 patches (16 frame runs of
144 placeholder tokens, 2,304 in all, between timestamps), then gets a 16-token question. Side by
side, in one run, each timed to the first new token (median of ``--repeats``):

* **re-encode**: plain ``model.generate`` over the whole history with the video (what a server
  without state does, and what a fresh instance must do, since a moved cache drifts there);
* **plain cache, same instance**: ``generate`` from a copy of the prefix's ``DynamicCache`` with
  the full mask (the cheapest correct plain way, valid only on the instance that holds
  ``rope_deltas``; the copy is made outside the timing);
* **kvstate, memory**: ``fork().generate`` on the saved session;
* **kvstate, file**: ``Session.load`` of the state file, then ``generate`` (load included).

Writes ``bench/results/video.json``. Run: ``python bench/bench_video.py``.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from common import median_time, times, write_results
from kvstate import Session
from kvstate.testing.tiny import VIDEO_TOKEN, VISION_END, VISION_START, tiny_prompt

TEXT = dict(vocab_size=200, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
VISION = dict(depth=2, num_heads=2, in_channels=3, patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
              hidden_size=128, intermediate_size=256, out_hidden_size=256, num_position_embeddings=256,
              deepstack_visual_indexes=[0])


def build() -> torch.nn.Module:
    config = AutoConfig.for_model("qwen3_vl", image_token_id=190, video_token_id=VIDEO_TOKEN,
                                  vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                                  text_config=TEXT, vision_config=VISION)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=16, help="temporal patches of the video")
    parser.add_argument("--size", type=int, default=24, help="patches per side of a frame (even)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = build()
    h = w = args.size
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(args.frames * h * w, 3 * 2 * 2 * 2, generator=gen)
    grid = torch.tensor([[args.frames, h, w]])
    row: list[int] = []
    for k in range(args.frames):
        row += [*tiny_prompt(2, seed=50 + k)[0].tolist(), VISION_START, *[VIDEO_TOKEN] * (h * w // 4), VISION_END]
    prefix = torch.cat([tiny_prompt(8), torch.tensor([row]), tiny_prompt(8, seed=2)], 1)
    question = tiny_prompt(16, seed=3)
    ids = torch.cat([prefix, question], 1)
    video = {"pixel_values_videos": pixels, "video_grid_thw": grid}
    types = 2 * (ids == VIDEO_TOKEN).int()

    session = Session(model)
    session.extend(prefix, **video)
    folder = Path(tempfile.mkdtemp())
    session.save(folder / "video.kvs")
    one = dict(max_new_tokens=1, do_sample=False)
    out = model(prefix, use_cache=True, mm_token_type_ids=types[:, :prefix.shape[1]], **video)
    cache = out.cache  # on this instance, which now holds the prefix's rope_deltas

    def plain_cache(c: object) -> torch.Tensor:
        return model.generate(question, attention_mask=torch.ones_like(ids), cache=c, **one)

    answers = {
        "reencode": model.generate(ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types, **video,
                                   **one)[:, ids.shape[1]:],
        "plain_cache_same_instance": plain_cache(copy.deepcopy(cache))[:, -1:],
        "kvstate_memory": session.fork().generate(ids, **one),
        "kvstate_file": Session.load(folder / "video.kvs", model).generate(ids, **one),
    }
    seconds = {
        "reencode": median_time(lambda: model.generate(ids, attention_mask=torch.ones_like(ids),
                                                       mm_token_type_ids=types, **video, **one), args.repeats),
        "plain_cache_same_instance": sorted(times(plain_cache, args.repeats,
                                                  setup=lambda: copy.deepcopy(cache)))[args.repeats // 2],
        "kvstate_memory": median_time(lambda: session.fork().generate(ids, **one), args.repeats),
        "kvstate_file": median_time(lambda: Session.load(folder / "video.kvs", model).generate(ids, **one),
                                    args.repeats),
    }
    write_results("video", {
        "model": "Qwen3-VL, random weights (text hidden 256 x 4 layers, vision depth 2), fp32, CPU",
        "video": {"temporal_patches": args.frames, "patches_per_frame": h * w,
                  "placeholder_tokens": args.frames * h * w // 4},
        "history_tokens": int(prefix.shape[1]), "question_tokens": int(question.shape[1]),
        "repeats": args.repeats, "seconds": seconds,
        "reencode_over_kvstate_memory": seconds["reencode"] / seconds["kvstate_memory"],
        "reencode_over_kvstate_file": seconds["reencode"] / seconds["kvstate_file"],
        "kvstate_memory_over_plain_cache": seconds["kvstate_memory"] / seconds["plain_cache_same_instance"],
        "first_tokens": {k: v.tolist() for k, v in answers.items()},
        "same_first_token": len({tuple(v.flatten().tolist()) for v in answers.values()}) == 1,
        "state_file_bytes": (folder / "video.kvs").stat().st_size,
    })


if __name__ == "__main__":
    main()
