"""Misuse of the library's calls raises a typed kvstate error before anything runs.

Two tables: the call and the ``KVStateError`` subclass it must raise, with found / fix in the
message. The first holds the misuses an adversarial pass found (ids, settings, media inputs,
save targets); the second the ones that had escaped as untyped errors or ran on nonsense (what is
not a model, generate's length rule, ``continue_text``'s arguments, options transformers refuses
late, masks that are not 0/1), whose message must also fit on one line. Nothing runs the model and
the state is bitwise unchanged; controls show that the nearest valid calls still answer as plain
``generate``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig, LlamaForCausalLM

from kvstate import Session, continue_text
from kvstate.errors import (
    GenerationOptionError,
    InputError,
    KVStateError,
    MaskError,
    StateFileError,
    UnsupportedError,
)
from kvstate.testing.tiny import image_span, tiny_image, tiny_video, video_span
from kvstate.testing.tiny_tokenizer import tiny_tokenizer
from tiny import assert_same_state, count_forwards, prompt, snapshot, tiny_model

T = 8  # tokens the llama session has processed


@pytest.fixture(scope="module")
def sessions():
    llama = Session(tiny_model("llama"))
    llama.extend(prompt(T))
    return {"llama": llama, "empty": Session(llama.model), "mamba": Session(tiny_model("mamba")),
            "vl": Session(tiny_model("qwen3_vl"))}


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
def test_misuse_raises_a_typed_error(name, sessions):
    text = _refused(sessions, *CASES[name])
    assert "found:" in text and "fix:" in text, text


def _refused(sessions, which, call, error) -> str:
    """``call`` on session ``which`` raises ``error`` (a ``KVStateError``) before any forward, the state
    unchanged; the error's text."""
    session = sessions[which]
    before = snapshot(session.state)
    with count_forwards(session.model) as calls, pytest.raises(error) as info:
        call(session)
    assert isinstance(info.value, KVStateError)
    assert calls[0] == 0
    assert_same_state(session.state, before)
    return str(info.value)


def history(n_new=3):
    return torch.cat([prompt(T), prompt(n_new, seed=5)], 1)


def mask_with(value, length=T + 3, dtype=torch.float32):
    mask = torch.ones(1, length, dtype=dtype)
    mask[0, -2] = value
    return mask


TOKENIZER = tiny_tokenizer()


GENERATE_CASES = {
    # a model that is not one
    "Session(object())": ("llama", lambda s: Session(object()), InputError),
    "Session(None)": ("llama", lambda s: Session(None), InputError),
    "Session of the model class": ("llama", lambda s: Session(LlamaForCausalLM), InputError),
    "Session of a bare torch module": ("llama", lambda s: Session(torch.nn.Linear(2, 2)), InputError),
    "Session(model, state=object())": ("llama", lambda s: Session(s.model, state=object()), InputError),
    "Session(model, tokenizer=3)": ("llama", lambda s: Session(s.model, tokenizer=3), InputError),
    # generate's own length rule, typed and before anything runs
    "max_length = len(history)": ("llama", lambda s: s.generate(history(), max_length=T + 3), InputError),
    "max_length < len(history)": ("llama", lambda s: s.generate(history(), max_length=4), InputError),
    "max_length in a GenerationConfig": ("llama", lambda s: s.generate(
        history(), generation_config=GenerationConfig(max_length=T + 3)), InputError),
    "a history as long as max_position_embeddings": ("llama", lambda s: s.generate(
        torch.randint(3, 100, (1, 512))), InputError),
    "max_length as a string": ("llama", lambda s: s.generate(history(), max_length="9"), InputError),
    "an empty history": ("llama", lambda s: s.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2),
                         InputError),
    "a pad id that is not an id": ("llama", lambda s: s.generate(history(), max_new_tokens=2, pad_token_id=1.5),
                                   InputError),
    # continue_text takes a session, a tokenizer and text
    "continue_text(None session)": ("llama", lambda s: continue_text(None, TOKENIZER, "hi"), InputError),
    "continue_text(no tokenizer)": ("llama", lambda s: continue_text(s, None, "hi"), InputError),
    "continue_text(bytes)": ("llama", lambda s: continue_text(s, TOKENIZER, b"hello", max_new_tokens=2), InputError),
    "continue_text(None)": ("llama", lambda s: continue_text(s, TOKENIZER, None, max_new_tokens=2), InputError),
    "continue_text(int)": ("llama", lambda s: continue_text(s, TOKENIZER, 7, max_new_tokens=2), InputError),
    "continue_text(output_scores=True)": ("llama", lambda s: continue_text(
        s, TOKENIZER, "hi", max_new_tokens=2, output_scores=True, return_dict_in_generate=True), InputError),
    "continue_text(output_logits=True) in a GenerationConfig": ("llama", lambda s: continue_text(
        s, TOKENIZER, "hi", generation_config=GenerationConfig(max_new_tokens=2, output_logits=True,
                                                               return_dict_in_generate=True)), InputError),
    # options transformers refuses as generate starts, typed (and still ValueErrors)
    "sampling at a NaN temperature": ("llama", lambda s: s.generate(
        history(), do_sample=True, temperature=float("nan"), max_new_tokens=2), GenerationOptionError),
    "sampling at a negative temperature": ("llama", lambda s: s.generate(
        history(), do_sample=True, temperature=-1.0, max_new_tokens=2), GenerationOptionError),
    "top_k -3": ("llama", lambda s: s.generate(history(), do_sample=True, top_k=-3, max_new_tokens=2),
                 GenerationOptionError),
    "min_p 2": ("llama", lambda s: s.generate(history(), do_sample=True, min_p=2.0, max_new_tokens=2),
                GenerationOptionError),
    "repetition_penalty 0": ("llama", lambda s: s.generate(history(), repetition_penalty=0.0, max_new_tokens=2),
                             GenerationOptionError),
    "a sequence_bias outside the vocabulary": ("llama", lambda s: s.generate(
        history(), sequence_bias=[[[10**6], 1.0]], max_new_tokens=2), GenerationOptionError),
    "stop_strings without tokenizer=": ("llama", lambda s: s.generate(history(), stop_strings=["x"],
                                                                      max_new_tokens=2), GenerationOptionError),
    "a stop string of 5000 characters": ("llama", lambda s: s.generate(
        history(), stop_strings=["z" * 5000], tokenizer=TOKENIZER, max_new_tokens=2), GenerationOptionError),
    "17 stop strings": ("llama", lambda s: s.generate(
        history(), stop_strings=[f"s{i}" for i in range(17)], tokenizer=TOKENIZER, max_new_tokens=2),
                        GenerationOptionError),
    # masks hold 0 and 1, and every row attends to something
    "extend: a mask of 0.5": ("llama", lambda s: s.extend(prompt(3, seed=5), mask_with(0.5)), MaskError),
    "generate: a mask of 0.5": ("llama", lambda s: s.generate(history(), mask_with(0.5), max_new_tokens=2),
                                MaskError),
    "generate: a mask of 2": ("llama", lambda s: s.generate(history(), mask_with(2, dtype=torch.long),
                                                            max_new_tokens=2), MaskError),
    "generate: a mask of -1": ("llama", lambda s: s.generate(history(), mask_with(-1, dtype=torch.int8),
                                                             max_new_tokens=2), MaskError),
    "generate: a NaN in the mask": ("llama", lambda s: s.generate(history(), mask_with(float("nan")),
                                                                  max_new_tokens=2), MaskError),
    "generate: a complex mask": ("llama", lambda s: s.generate(history(), torch.ones(1, T + 3, dtype=torch.cfloat),
                                                               max_new_tokens=2), MaskError),
    "extend: an all-zero mask row": ("llama", lambda s: s.extend(prompt(3, seed=5), torch.zeros(1, T + 3)),
                                     MaskError),
    "extend on an empty state: an all-zero mask row": ("empty", lambda s: s.extend(prompt(3), torch.zeros(1, 3)),
                                                       MaskError),
    "generate: an all-zero mask row": ("llama", lambda s: s.generate(
        history(), torch.zeros(1, T + 3, dtype=torch.long), max_new_tokens=2), MaskError),
    "generate: a bool all-False row in a batch": ("mamba", lambda s: s.generate(
        prompt(4, batch=2), torch.tensor([[True] * 4, [False] * 4]), max_new_tokens=2), MaskError),
    "generate: a history of pad ids only, no mask": ("llama", lambda s: s.generate(
        torch.zeros(1, 5, dtype=torch.long), max_new_tokens=2), MaskError),
    # generate's default mask is padding: a family without padding refuses it
    "mamba: a pad id in a history without a mask": ("mamba", lambda s: s.generate(
        torch.tensor([[5, 0, 7, 9]]), max_new_tokens=2), UnsupportedError),
}


@pytest.mark.parametrize("name", sorted(GENERATE_CASES))
def test_misused_sessions_generate_and_masks_raise_a_one_line_typed_error(name, sessions):
    text = _refused(sessions, *GENERATE_CASES[name])
    assert "found:" in text and "fix:" in text and "\n" not in text, text


@pytest.mark.parametrize("mask", [torch.ones(1, T + 3, dtype=torch.bool), torch.ones(1, T + 3, dtype=torch.long),
                                  torch.ones(1, T + 3), torch.ones(1, T + 3, dtype=torch.float16)],
                         ids=["bool", "int64", "float32", "float16"])
def test_binary_masks_of_any_real_dtype_are_accepted(mask, sessions):
    """Control: 0/1 masks in any real dtype still mean what they say (plain generate agrees)."""
    s = sessions["llama"].fork()
    new = s.generate(history(), mask, max_new_tokens=3, do_sample=False)
    plain = s.model.generate(history(), attention_mask=mask.long(), max_new_tokens=3, do_sample=False)
    assert torch.equal(new, plain[:, T + 3:])


@pytest.mark.parametrize("max_length", [T + 4, T + 6])
def test_max_length_just_past_the_history_still_generates(max_length, sessions):
    s = sessions["llama"].fork()
    new = s.generate(history(), max_length=max_length, do_sample=False)
    plain = s.model.generate(history(), max_length=max_length, do_sample=False)
    assert torch.equal(new, plain[:, T + 3:]) and new.shape[1] == max_length - T - 3


def test_a_mask_that_contradicts_a_long_state_is_summarised(sessions):
    """The error names how many slots differ and the first few, not both whole masks."""
    s = Session(sessions["llama"].model)
    s.extend(prompt(300))
    mask = torch.ones(1, 303, dtype=torch.long)
    mask[0, [7, 90, 91, 200]] = 0
    with pytest.raises(MaskError) as info:
        s.extend(prompt(3, seed=5), mask)
    text = str(info.value)
    assert len(text) < 400 and "4 of 300 slots differ" in text and "row 0 slot 7: 0 (state: 1)" in text, text


def test_a_refused_generation_option_is_still_the_value_error_transformers_raised(sessions):
    """Code that caught transformers' ``ValueError`` still catches it; the cause stays attached."""
    with pytest.raises(ValueError, match="temperature") as info:
        sessions["llama"].fork().generate(history(), do_sample=True, temperature=float("nan"), max_new_tokens=2)
    assert isinstance(info.value, GenerationOptionError) and type(info.value.__cause__) is ValueError
