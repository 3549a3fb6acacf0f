"""Every generation option equals ``model.generate``, in every state.

The matrix: options x {fresh, partly processed, fully processed, rolled back, compressed,
after load} x {llama, gemma3_text (sliding), qwen3_vl with an image, lfm2, recurrent_gemma}.
Each case runs ``Session.generate(full history, **option)`` and plain
``model.generate(full history, **option)`` with the same seed, and must give the same
tokens (and, where the option returns them, the same scores, logits and streamer echo).
The reference is computed once per (family, option) and shared by the six states.

The compressed state evicts half the slots of one attention layer whose output
projection is zeroed (``mute_attention``), so eviction cannot change any output and
plain ``generate`` on the full history stays the exact reference; every other layer
still runs under kvstate's per-layer masks. Refused options are checked at the end:
they raise before the model runs or the state changes.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria

from kvstate import Session
from kvstate.compress import KNorm, PerLayerBudget
from kvstate.errors import InputError, UnsupportedError
from kvstate.testing.tiny import IMAGE_TOKEN, image_span, tiny_image
from tiny import (
    Echo,
    assert_logits_close,
    assert_same_state,
    count_forwards,
    first_attention_layer,
    mute_attention,
    prompt,
    snapshot,
    tiny_model,
)

ARCHS = ["llama", "gemma3_text", "qwen3_vl", "lfm2", "recurrent_gemma"]
CONDITIONS = ["fresh", "partial", "processed", "rolled_back", "compressed", "loaded"]
# sessions run the canonical schedule with chunks of 8: a resume that does not end on a multiple
# of 8 restarts at the last one ("realign"); with 0 every "realign" below would read "continue"
CHUNK = 8
MODES = {"fresh": {"continue"}, "partial": {"continue", "realign"}, "processed": {"stored-logits"},
         "rolled_back": {"rollback", "checkpoint"}, "compressed": {"continue"}, "loaded": {"continue", "realign"}}
N = 6
SEED = 1234


class Ban(LogitsProcessor):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        scores[:, self.token] = -float("inf")
        return scores


class StopAfter(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@contextlib.contextmanager
def model_defaults(model, **values):
    """Options set on ``model.generation_config`` (restored afterwards)."""
    before = {k: getattr(model.generation_config, k) for k in values}
    for k, v in values.items():
        setattr(model.generation_config, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(model.generation_config, k, v)


# option name -> (world, model) -> (generate kwargs, context); built fresh for every call
OPTIONS = {
    "logits_processor": lambda w, m: ({"logits_processor": LogitsProcessorList([Ban(w.greedy[0])])}, None),
    "stopping_criteria": lambda w, m: ({"stopping_criteria": [StopAfter(w.length + 1)]}, None),
    "prefix_allowed_tokens_fn": lambda w, m: ({"prefix_allowed_tokens_fn": lambda b, ids: [7, 8]}, None),
    "bad_words_ids": lambda w, m: ({"bad_words_ids": [[w.greedy[0]], [w.greedy[2]]]}, None),
    "suppress_tokens": lambda w, m: ({"suppress_tokens": w.greedy[:2]}, None),
    "eos_token_id": lambda w, m: ({"eos_token_id": w.greedy[2]}, None),
    "min_new_tokens": lambda w, m: ({"min_new_tokens": 4, "eos_token_id": w.greedy[1]}, None),
    "max_length": lambda w, m: ({"max_length": w.length + 3, "max_new_tokens": None}, None),
    "no_repeat_ngram_size": lambda w, m: ({"no_repeat_ngram_size": 2}, None),
    "repetition_penalty": lambda w, m: ({"repetition_penalty": 50.0}, None),
    "sample_defaults": lambda w, m: ({"do_sample": True}, None),
    "temperature": lambda w, m: ({"do_sample": True, "temperature": 0.6}, None),
    "top_k": lambda w, m: ({"do_sample": True, "top_k": 5}, None),
    "top_p": lambda w, m: ({"do_sample": True, "top_p": 0.8, "top_k": 0}, None),
    "min_p": lambda w, m: ({"do_sample": True, "min_p": 0.05}, None),
    "typical_p": lambda w, m: ({"do_sample": True, "typical_p": 0.9}, None),
    "generation_config": lambda w, m: (
        {"generation_config": GenerationConfig(do_sample=True, top_k=7, max_new_tokens=N, pad_token_id=0)}, None),
    "model_generation_config": lambda w, m: ({}, model_defaults(m, do_sample=True, top_p=0.9, max_new_tokens=N)),
    "return_dict_scores_logits": lambda w, m: (
        {"return_dict_in_generate": True, "output_scores": True, "output_logits": True}, None),
    "streamer": lambda w, m: ({"streamer": Echo()}, None),
    "use_cache_false": lambda w, m: ({"use_cache": False}, None),  # plain recomputes every step; same tokens
}


# Deterministic options that change plain greedy's tokens on every family here.
EFFECTIVE = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "bad_words_ids", "suppress_tokens",
             "eos_token_id", "max_length", "repetition_penalty")


class World:
    """One family's model, history and the six starting states (built once, forked per case)."""

    def __init__(self, arch: str, folder):
        self.arch = arch
        self.model = tiny_model(arch)
        self.muted = mute_attention(tiny_model(arch), first_attention_layer(self.model))
        if arch == "qwen3_vl":
            pixels, grid, n = tiny_image((4, 6), seed=3)
            self.history = torch.cat([prompt(8, seed=5), image_span(n), prompt(14, seed=6)], 1)
            self.inputs = {"pixel_values": pixels, "image_grid_thw": grid}
        else:
            self.history, self.inputs = prompt(30, seed=5), {}
        self.length = self.history.shape[1]
        self.split = self.length - 6
        self.greedy = self.plain(self.model, {"do_sample": False})[0].tolist()
        self.folder = folder
        self.bases: dict[str, Session] = {}

    def plain(self, model, kwargs):
        """New tokens (and the output object) of plain ``model.generate`` over the full history."""
        extra = {**self.inputs, "mm_token_type_ids": (self.history == IMAGE_TOKEN).int()} if self.inputs else {}
        kwargs = {"max_new_tokens": N, **kwargs}
        torch.manual_seed(SEED)
        out = model.generate(self.history, attention_mask=torch.ones_like(self.history), **extra, **kwargs)
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        return sequences[0, self.length:], out

    def session(self, condition: str) -> Session:
        if condition not in self.bases:
            self.bases[condition] = self._build(condition)
        return self.bases[condition].fork()

    def _build(self, condition: str) -> Session:
        model = self.muted if condition == "compressed" else self.model
        s = Session(model, canonical_chunk=CHUNK)
        prefix = self.history[:, :self.split]
        if condition == "processed":
            s.extend(self.history, **self.inputs)
        elif condition != "fresh":
            s.extend(prefix, **self.inputs)
        if condition == "rolled_back":
            s.extend(prompt(5, seed=9))  # a continuation the history does not share
        if condition == "compressed":
            ratios = tuple(0.5 if i == first_attention_layer(model) else 0.0 for i in range(len(s.state.layers)))
            s.compress(PerLayerBudget(0.5, policy=KNorm(), ratios=ratios))
            assert any(getattr(x, "compressed", False) for x in s.state.layers)
        if condition == "loaded":
            path = self.folder / f"{self.arch}.kvs"
            s.save(path)
            s = Session.load(path, tiny_model(self.arch))  # a fresh instance, same weights
        return s


@functools.cache
def world(arch: str) -> World:
    import tempfile
    from pathlib import Path

    return World(arch, Path(tempfile.mkdtemp(prefix="kvstate-options-")))


def compare(option: str, condition: str, mine, theirs) -> None:
    (mine_tokens, mine_out), (ref_tokens, ref_out) = mine, theirs
    what = f"{option} / {condition}"
    assert mine_tokens.tolist() == ref_tokens.tolist(), f"{what}: {mine_tokens.tolist()} != {ref_tokens.tolist()}"
    if option == "return_dict_scores_logits":
        assert len(mine_out.scores) == len(ref_out.scores) == len(mine_out.logits)
        for a, b in zip(mine_out.logits, ref_out.logits, strict=True):
            assert_logits_close(a, b, f"{what}: logits")
        for a, b in zip(mine_out.scores, ref_out.scores, strict=True):
            finite = torch.isfinite(b)
            assert torch.equal(finite, torch.isfinite(a)), f"{what}: processed scores differ in support"
            assert_logits_close(a[finite], b[finite], f"{what}: scores")


def run_session(w: World, session: Session, kwargs: dict):
    torch.manual_seed(SEED)
    out = session.generate(w.history, **w.inputs, **{"max_new_tokens": N, **kwargs})
    tokens = out if isinstance(out, torch.Tensor) else out.sequences
    return tokens[0], out


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("arch", ARCHS)
def test_option_equals_plain_generate_in_every_state(arch, option):
    w = world(arch)
    references = {}
    for condition in CONDITIONS:
        model = w.muted if condition == "compressed" else w.model
        key = "muted" if condition == "compressed" else "model"
        if key not in references:
            ref_kwargs, context = OPTIONS[option](w, model)
            with context or contextlib.nullcontext():
                references[key] = (w.plain(model, ref_kwargs), ref_kwargs)
        (ref_tokens, ref_out), ref_kwargs = references[key]
        if key == "model" and option in EFFECTIVE:  # the option must matter, or the case proves nothing
            assert ref_tokens.tolist() != w.greedy, f"{option} left the greedy tokens unchanged"
        session = w.session(condition)
        kwargs, context = OPTIONS[option](w, session.model)  # "loaded" runs on another instance
        with context or contextlib.nullcontext():
            mine = run_session(w, session, kwargs)
        assert session.last_plan.mode in MODES[condition], (condition, session.last_plan)
        compare(option, condition, mine, (ref_tokens, ref_out))
        if option == "streamer":  # the echo equals what plain generate puts: the history once, then each token
            theirs, ours = ref_kwargs["streamer"], kwargs["streamer"]
            assert [p.tolist() for p in ours.puts] == [p.tolist() for p in theirs.puts], condition
            assert ours.ended == theirs.ended == 1


REFUSED = {
    "num_beams": ({"num_beams": 2}, UnsupportedError),
    "num_return_sequences": ({"do_sample": True, "num_return_sequences": 2}, UnsupportedError),
    "output_attentions": ({"return_dict_in_generate": True, "output_attentions": True}, UnsupportedError),
    "output_hidden_states": ({"return_dict_in_generate": True, "output_hidden_states": True}, UnsupportedError),
    "cache_implementation": ({"cache_implementation": "static"}, UnsupportedError),
    "guidance_scale": ({"guidance_scale": 1.5}, UnsupportedError),
    "token_healing": ({"token_healing": True}, UnsupportedError),
    "penalty_alpha": ({"penalty_alpha": 0.6, "top_k": 4}, UnsupportedError),
    "assistant_model": ({"assistant_model": "x"}, UnsupportedError),
    "negative_prompt_ids": ({"negative_prompt_ids": torch.tensor([[3, 4]])}, UnsupportedError),
    "unknown keyword": ({"temprature": 0.5}, InputError),
    "position_ids": ({"position_ids": torch.arange(30)[None]}, InputError),
    "cache": ({"cache": None, "past_key_values": None}, InputError),
    "bad generation_config": ({"generation_config": {"do_sample": True}}, InputError),
}


@pytest.mark.parametrize("arch", ["llama", "qwen3_vl", "recurrent_gemma"])
def test_refused_options_raise_before_anything_runs(arch):
    w = world(arch)
    for condition in ("fresh", "partial", "processed", "compressed"):
        for name, (kwargs, error) in REFUSED.items():
            session = w.session(condition)
            before = snapshot(session.state)
            with count_forwards(session.model) as calls, pytest.raises(error) as info:
                session.generate(w.history, max_new_tokens=N, **w.inputs, **kwargs)
            assert calls[0] == 0, f"{name}: the model ran before the refusal"
            assert "fix:" in str(info.value), name
            assert_same_state(session.state, before)


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "jamba"])
def test_streamer_echo_on_pure_recurrent_and_stepwise_families(arch):
    """The echo is the whole history on every family (it was only the suffix for Mamba continuations)."""
    model = tiny_model(arch)
    history = prompt(20, seed=5)
    theirs, ours = Echo(), Echo()
    ref = model.generate(history, attention_mask=torch.ones_like(history), max_new_tokens=N, do_sample=False,
                         streamer=theirs)
    s = Session(model)
    s.extend(history[:, :14])
    tokens = s.generate(history, max_new_tokens=N, do_sample=False, streamer=ours)
    assert torch.equal(tokens, ref[:, 20:])
    assert [p.tolist() for p in ours.puts] == [p.tolist() for p in theirs.puts]


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_a_streamer_with_put_logits_gets_each_steps_raw_logits(arch):
    """Before each put of new tokens, a streamer that has ``put_logits`` gets the raw logits they were chosen
    from: the same tensors as ``output_logits``, warm (after a resume) and with the puts unchanged."""
    class Logits(Echo):
        def __init__(self) -> None:
            super().__init__()
            self.logits: list[torch.Tensor] = []

        def put_logits(self, logits: torch.Tensor) -> None:
            assert len(self.logits) == len(self.puts) - 1, "logits come right before their tokens' put"
            self.logits.append(logits)

    model = tiny_model(arch)
    history = prompt(20, seed=5)
    s = Session(model)
    s.extend(history[:, :13])
    streamer, plain = Logits(), Echo()
    out = s.generate(history, max_new_tokens=N, do_sample=False, streamer=streamer, output_logits=True,
                     return_dict_in_generate=True, repetition_penalty=1.3)
    assert len(streamer.logits) == len(out.logits) == N
    assert all(torch.equal(a.float(), b) for a, b in zip(streamer.logits, out.logits, strict=True))
    Session(model).generate(history, max_new_tokens=N, do_sample=False, streamer=plain, repetition_penalty=1.3)
    assert [p.tolist() for p in streamer.puts] == [p.tolist() for p in plain.puts]
