"""Issue 11, acceptance 4: every misuse found by the adversarial pass raises a typed kvstate error.

One table: the call, the ``KVStateError`` subclass it must raise, and (checked for all)
a message with expected / found / fix. Nothing runs the model, and the state does not change.
"""

from __future__ import annotations

import pytest
import torch

from kvstate import Session
from kvstate.errors import InputError, KVStateError, StateFileError, UnsupportedError
from kvstate.testing.tiny import image_span, tiny_image, tiny_video, video_span
from tiny import assert_same_state, count_forwards, prompt, snapshot, tiny_model


@pytest.fixture(scope="module")
def llama():
    s = Session(tiny_model("llama"))
    s.extend(prompt(8))
    return s


@pytest.fixture(scope="module")
def vl():
    return Session(tiny_model("qwen3_vl"))


def image_history(n_tokens=None):
    pixels, grid, n = tiny_image((4, 6))
    return torch.cat([prompt(4), image_span(n if n_tokens is None else n_tokens), prompt(3)], 1), pixels, grid


def video_history():
    pixels, grid = tiny_video()
    return torch.cat([prompt(4), video_span("qwen3_vl", grid), prompt(3)], 1), pixels, grid


CASES = {
    "negative id": ("llama", lambda s: s.extend(torch.tensor([[3, -1]])), InputError),
    "out-of-vocab id": ("llama", lambda s: s.extend(torch.tensor([[3, 100_000]])), InputError),
    "ragged id lists": ("llama", lambda s: s.extend([[3, 4], [5]]), InputError),
    "string ids": ("llama", lambda s: s.extend(["hello"]), InputError),
    "float ids": ("llama", lambda s: s.extend(torch.rand(1, 3)), InputError),
    "ids on the meta device": ("llama", lambda s: s.extend(torch.zeros(1, 2, dtype=torch.long, device="meta")),
                               InputError),
    "generate: out-of-vocab history": ("llama", lambda s: s.generate(torch.tensor([[3, 999]])), InputError),
    "truncate(2.5)": ("llama", lambda s: s.truncate(2.5), InputError),
    "truncate('3')": ("llama", lambda s: s.truncate("3"), InputError),
    "checkpoint_every=-4": ("llama", lambda s: Session(s.model, checkpoint_every=-4), InputError),
    "checkpoint_every=0": ("llama", lambda s: Session(s.model, checkpoint_every=0), InputError),
    "max_checkpoints=-1": ("llama", lambda s: Session(s.model, max_checkpoints=-1), InputError),
    "chunk_size=0": ("llama", lambda s: Session(s.model, chunk_size=0), InputError),
    "sliding_reserve=1.5": ("llama", lambda s: Session(s.model, sliding_reserve=1.5), InputError),
    "unknown model input": ("llama", lambda s: s.extend(prompt(2), frames_per_second=torch.rand(4)), InputError),
    "media on a text-only family": ("llama", lambda s: s.extend(prompt(2), pixel_values=torch.rand(4, 24)),
                                    UnsupportedError),
    "media to generate on a text-only family": ("llama", lambda s: s.generate(prompt(2), pixel_values=torch.rand(
        4, 24), max_new_tokens=2), UnsupportedError),
    "save onto a folder": ("llama", lambda s: s.save("/tmp"), StateFileError),
    "save into a missing folder": ("llama", lambda s: s.save("/tmp/kvstate-no-such-folder/s.kvs"), StateFileError),
    "pixels without image_grid_thw": ("vl", lambda s: s.extend(image_history()[0], pixel_values=image_history()[1]),
                                      InputError),
    "too few placeholder tokens": ("vl", lambda s: s.extend(image_history(n_tokens=4)[0],
                                                            pixel_values=image_history()[1],
                                                            image_grid_thw=image_history()[2]), InputError),
    "image placeholders without pixels": ("vl", lambda s: s.generate(image_history()[0], max_new_tokens=2),
                                          InputError),
    "video pixels do not match the grid": ("vl", lambda s: s.extend(
        video_history()[0], pixel_values_videos=video_history()[1][:-1], video_grid_thw=video_history()[2]),
        InputError),
    "video placeholders without pixels": ("vl", lambda s: s.generate(video_history()[0], max_new_tokens=2),
                                          InputError),
    "second_per_grid_ts without its video": ("vl", lambda s: s.generate(
        video_history()[0], pixel_values_videos=video_history()[1], video_grid_thw=video_history()[2],
        second_per_grid_ts=torch.tensor([1.0, 1.0]), max_new_tokens=2), InputError),
    "two rows with one image each": ("vl", lambda s: s.extend(
        torch.cat([image_history()[0]] * 2), pixel_values=torch.cat([image_history()[1]] * 2),
        image_grid_thw=torch.cat([image_history()[2]] * 2)), UnsupportedError),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_misuse_raises_a_typed_error(name, llama, vl):
    which, call, error = CASES[name]
    session = llama if which == "llama" else vl
    before = snapshot(session.state)
    with count_forwards(session.model) as calls, pytest.raises(error) as info:
        call(session)
    assert isinstance(info.value, KVStateError)
    text = str(info.value)
    assert "found:" in text and "fix:" in text, text
    assert calls[0] == 0
    assert_same_state(session.state, before)
