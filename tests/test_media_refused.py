"""Image-text families without a media adapter. Their text path is exact or refused by
the self-check, and their media inputs are refused before anything runs (never silently dropped)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText

from kvstate import Session
from kvstate.errors import UnsupportedError, UnsupportedModelError
from kvstate.testing.shrink import shrink_config
from tiny import prompt


def build(model_type):
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(shrink_config(model_type)).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("model_type", ["llava", "mllama"])
def test_text_is_exact_and_media_are_refused(model_type):
    model = build(model_type)
    s = Session(model)
    ids = prompt(12, seed=3)
    before = s.state
    with pytest.raises(UnsupportedError, match="text state only"):
        s.extend(ids, pixel_values=torch.zeros(1, 3, 8, 8))
    with pytest.raises(UnsupportedError, match="text state only"):
        s.generate(ids, pixel_values=torch.zeros(1, 3, 8, 8), max_new_tokens=2)
    assert s.state is before
    s.extend(ids[:, :6])
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert torch.equal(s.generate(ids, max_new_tokens=4, do_sample=False), plain[:, ids.shape[1]:])


def test_paligemma_prefix_lm_is_refused_by_the_self_check():
    """PaliGemma's prefix attends bidirectionally (a prefix-LM): a later token changes earlier K/V."""
    with pytest.raises(UnsupportedModelError, match="attention is not causal"):
        Session(build("paligemma"))
