"""A prompt past a model's learned position table is a 400 ``context_length_exceeded``, not a 500 from inside the
forward (GPT-2's position embedding has no row past ``n_positions``: a held-out probe got an IndexError). Rotary
models have no such table and run past their trained length, as plain ``generate`` lets them."""

from __future__ import annotations

import openai
import pytest

from kvstate.adopt import context_length
from kvstate.serve.cli import load
from serving import client, live, make_server


def test_a_request_past_a_learned_position_table_is_a_400_and_the_server_stays_healthy():
    model, tokenizer = load("tiny:gpt2")
    assert context_length(model) == model.config.n_positions
    server = make_server(model, tokenizer, name="tiny:gpt2")
    with live(server) as url:
        api = client(url)
        for prompt, max_tokens in (("ab" * 300, 5), ("ab " * 20, model.config.n_positions)):
            with pytest.raises(openai.BadRequestError) as info:
                api.completions.create(model="tiny:gpt2", prompt=prompt, max_tokens=max_tokens)
            assert info.value.code == "context_length_exceeded" and "maximum context length" in str(info.value)
        ok = api.completions.create(model="tiny:gpt2", prompt="ab " * 20, max_tokens=5, temperature=0)
        assert ok.usage.completion_tokens >= 1


def test_rotary_models_have_no_table_to_run_past():
    model, _ = load("tiny:llama")
    assert context_length(model) is None
