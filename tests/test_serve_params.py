"""OpenAI sampling parameters give the tokens ``model.generate`` gives with the documented mapping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.serving import client, live, make_server

from kvstate.serve.cli import load
from kvstate.serve.params import COMPLETION_FIELDS, Limits, OpenAIPenalties, parse

PROMPTS = ["The cat sat on", "Once upon a time, in a", "Numbers: 1, 2, 3,"]


@pytest.fixture(scope="module")
def served():
    model, tokenizer = load("tiny:llama")
    # no pool: every request is a fresh prefill, so sampled tokens compare bit for bit with model.generate
    with live(make_server(model, tokenizer, pool_bytes=0)) as url:
        yield model, tokenizer, client(url)


def _plain(model, tokenizer, prompt: str, body: dict) -> str:
    """``model.generate`` with the mapping written out by hand (docs/serve.md)."""
    greedy = body["temperature"] == 0
    options = {"max_new_tokens": body["max_tokens"], "do_sample": not greedy}
    if not greedy:
        options.update(temperature=body["temperature"], top_p=body.get("top_p", 1.0), top_k=body.get("top_k", 0))
    # a stop applies to the answer's text: transformers' StopStringCriteria also matches the literal text of
    # special tokens ("<eos>" holds "e", and the tiny model's EOS is no stop), which the text never shows, so
    # the oracle generates the whole answer and cuts its text at the first stop
    if body.get("logit_bias"):
        options["sequence_bias"] = [[[int(k)], float(v)] for k, v in body["logit_bias"].items()]
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        options["logits_processor"] = [OpenAIPenalties(body.get("presence_penalty", 0.0),
                                                       body.get("frequency_penalty", 0.0))]
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    torch.manual_seed(body["seed"])
    out = model.generate(ids, **options)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    cuts = [i for i in (text.find(s) for s in body.get("stop") or []) if i >= 0]
    return text[:min(cuts)] if cuts else text


bodies = st.fixed_dictionaries({
    "temperature": st.sampled_from([0, 0.7, 1.0, 1.6]),
    "max_tokens": st.integers(1, 12),
    "seed": st.integers(0, 2**31 - 1),
}, optional={
    "top_p": st.sampled_from([0.5, 0.9, 1.0]),
    "top_k": st.sampled_from([0, 3, 20]),
    "stop": st.lists(st.sampled_from(["a", "e", " t", "!"]), min_size=1, max_size=2, unique=True),
    "logit_bias": st.dictionaries(st.integers(3, 99).map(str), st.sampled_from([-100.0, -5.0, 5.0, 100.0]),
                                  max_size=3),
    "presence_penalty": st.sampled_from([-1.0, 0.5, 2.0]),
    "frequency_penalty": st.sampled_from([-0.5, 1.0]),
})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies, prompt=st.sampled_from(PROMPTS), stream=st.booleans())
def test_sampling_parameters_equal_model_generate(served, body, prompt, stream):
    model, tokenizer, api = served
    standard = {k: v for k, v in body.items() if k != "top_k"}
    extra = {"extra_body": {"top_k": body["top_k"]}} if "top_k" in body else {}  # not in OpenAI's own API
    if stream:
        text = "".join(c.choices[0].text for c in api.completions.create(
            model="tiny:llama", prompt=prompt, stream=True, **standard, **extra) if c.choices)
    else:
        text = api.completions.create(model="tiny:llama", prompt=prompt, **standard, **extra).choices[0].text
    assert text == _plain(model, tokenizer, prompt, body)


def test_openai_penalties_follow_openai_formula():
    penalties = OpenAIPenalties(presence=0.5, frequency=0.25)
    scores = torch.zeros(1, 6)
    first = penalties(torch.tensor([[1, 1, 2]]), scores)  # the prompt: nothing generated yet
    assert torch.equal(first, scores)
    later = penalties(torch.tensor([[1, 1, 2, 4, 4, 5]]), scores)
    assert later.tolist() == [[0, 0, 0, 0, -(2 * 0.25 + 0.5), -(0.25 + 0.5)]]


def test_completion_defaults_are_openai_defaults():
    request = parse({"model": "m", "prompt": "x"}, COMPLETION_FIELDS, Limits(), default_max=16)
    assert request.options == {"max_new_tokens": 16, "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
