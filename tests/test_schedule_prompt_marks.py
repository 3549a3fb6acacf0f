"""Prompt marks: the canonical schedule of raw prompts (``kvstate.schedule.prompt``, ``kvstate.text.PromptMarks``).

A raw prompt is cut right after every occurrence of its own last line's label (``"A:"``), at a line start a gap
after the previous cut, and C after it otherwise. A Q&A client that appends the answer and the next question
then finds the previous prompt's end on a cut: each warm turn feeds the previous answer and its own tokens in
**one forward**, bit for bit the cold run (tokens and logits; through ``kvstate serve``, tokens and logprobs),
while a cold multi-line prompt is cut a gap apart instead of at every line. Oracles: the cuts against the rule
written out here (jump to the nearest of three candidates, not the implementation's scan), a new session or a
server that reuses nothing, plain ``model.generate``, and forwards counted on the model's embedding.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate import Session
from kvstate.errors import InputError, StateFileError
from kvstate.schedule import PROMPT, Canonical, lines, prompt
from kvstate.testing.tiny_tokenizer import tiny_tokenizer
from kvstate.text import PromptMarks
from tiny import tiny_model

NL, NL2, A, COLON, Q = 4, 5, 38, 31, 54  # a line break, a second line-start token, "A", ":", "Q" (hypothesis ids)


@functools.cache
def model_in(arch: str):
    return tiny_model(arch).to(torch.bfloat16)


@functools.cache
def tokenizer():
    return tiny_tokenizer()


def ids_of(text: str, bos: bool = False) -> list[int]:
    return [1] * bos + tokenizer()(text, add_special_tokens=False).input_ids


@contextlib.contextmanager
def forwards(model):
    """Counts the model's forwards (its input embedding runs once per forward): ``with forwards(m) as n: n[0]``.
    A global hook, so the model's own hook tables (part of its self-check key) stay as they were."""
    embedding, calls = model.get_input_embeddings(), [0]
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, _: calls.__setitem__(0, calls[0] + (module is embedding)))
    try:
        yield calls
    finally:
        handle.remove()


def rule_cuts(history: list[int], chunk: int, gap: int, label: tuple[int, ...], breaks: set[int]) -> list[int]:
    """The cuts of ``history`` written apart: from each cut, jump to the nearest of the end of the next line
    start followed by ``label``, the first line start ``gap`` or more after it, and the cut plus ``chunk``."""
    k = len(label)
    ends = {i + 1 + k for i in range(len(history) - k) if k and history[i] in breaks
            and tuple(history[i + 1:i + 1 + k]) == label}
    starts = [p for p, t in enumerate(history) if t in breaks]
    cuts, last = [], 0
    while True:
        nearest = min([last + chunk, *(e for e in ends if e > last), *(p for p in starts if p >= last + gap)])
        if nearest >= len(history):
            return [*cuts, len(history)]
        cuts.append(nearest)
        last = nearest


LABELS = st.sampled_from([(A, COLON), (COLON,), (A,), (), (COLON, NL)])


@settings(max_examples=120, deadline=None)
@given(st.lists(st.sampled_from([NL, NL2, A, COLON, 9, 9, 12]), min_size=1, max_size=90), st.integers(1, 12),
       st.integers(1, 12), LABELS)
def test_prompt_cuts_follow_the_rule_and_are_prefix_stable(history, chunk, gap, label):
    """The cuts are the rule's, and a state fed on any prefix holds the whole history's chunks up to where a
    resume restarts (its last chunk is canonical: no cut is decided by ids after it)."""
    schedule = Canonical(chunk, marks=prompt([NL, NL2], label, gap))
    full = schedule.cuts(0, len(history), (), history)
    assert full == rule_cuts(history, chunk, gap, label, {NL, NL2}), (full, history)
    for n in range(1, len(history)):
        pre = schedule.cuts(0, n, (), history[:n])
        assert schedule.keeps(pre[-2] if len(pre) > 1 else 0, n, history[:n]) == n
        restart = schedule.last_cut(n, (), history)
        assert [c for c in pre if c <= restart] == [c for c in full if c <= restart], (n, pre, full)
        assert schedule.settled_end(n, (), history) in [0, *(c for c in full if c <= n)]


def test_a_cold_multi_line_document_is_cut_a_gap_apart_not_at_every_line():
    history = [1, *[NL, 9, 9, 9, 9, 9] * 20, NL, Q, COLON, 9, NL, A, COLON]  # 20 lines of 6 tokens, "Q: .", "A:"
    cuts = Canonical(64, marks=prompt([NL], (A, COLON), 16)).cuts(0, len(history), (), history)
    assert cuts == [19, 37, 55, 73, 91, 109, 125, 128]  # 8 forwards
    assert len(Canonical(64, marks=lines([NL])).cuts(0, len(history), (), history)) == 22  # line marks: a line each


def test_prompt_marks_label_the_last_line_when_it_is_a_label():
    marks = PromptMarks(tokenizer(), gap=16)
    doc = "The sea is wide.\nThe sky is blue.\n\nQ: what is wide?\n"
    cases = {"A:": "A:", "Answer: ": "Answer: ", "### Response:\n": "### Response:\n",
             "The sea": None, "x" * 20 + ":": None, "": None}
    for last, label in cases.items():
        ids = ids_of(doc + last, bos=True)
        found = marks(ids)
        assert found[:2] == (PROMPT, 16) and found[3 + found[2]:] == (NL,)
        assert found[3:3 + found[2]] == (() if label is None else tuple(ids_of(label))), (last, found)
    assert marks(ids_of("no line break here:")) == prompt([NL], (), 16)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_raw_qa_turn_is_one_forward_and_answers_as_the_cold_run(arch):
    """A document of lines, then ``Q: ...\\nA:`` turns, each appending the previous answer: every warm turn reuses
    the whole previous prompt and feeds the answer and its own tokens in one forward, bitwise a new session."""
    model = model_in(arch)
    text = ids_of("".join(f"Line {i} of the document.\n" for i in range(5)) + "\nQ: what is it?\nA:", bos=True)
    marks = PromptMarks(tokenizer(), gap=32)(text)
    assert marks[3:3 + marks[2]] == tuple(ids_of("A:"))
    s, previous = Session(model, canonical_chunk=128, canonical_marks=marks), 0
    for turn in range(3):
        ids = torch.tensor([text])
        with forwards(model) as calls:
            out = s.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
        cold = Session(model, canonical_chunk=128, canonical_marks=marks).generate(
            ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True)
        assert torch.equal(out.sequences, cold.sequences), f"turn {turn}: tokens"
        assert torch.equal(torch.cat(out.logits), torch.cat(cold.logits)), f"turn {turn}: logits"
        prefill = calls[0] - (out.sequences.shape[1] - 1)
        if turn:
            assert s.last_plan.reused == previous and prefill == 1, (turn, s.last_plan, prefill)
        previous = len(text)
        answer = [t % 60 + 40 for t in out.sequences[0].tolist()]  # as a client keeps it: no line break
        text = text + answer + ids_of(f"\nQ: and question {turn}?\nA:")


def test_a_settle_under_prompt_marks_feeds_only_up_to_a_cut_its_ids_decide():
    """A reply's settle (``Session.settle(through=...)``) ends on a cut the prompt and the answer decide: none
    for a short answer (the next turn feeds it with its own tokens anyway), the last line a gap on for a long
    one, and the next turn resumes there and answers bitwise as the cold run."""
    model = model_in("llama")
    text = ids_of("The document.\nQ: what?\nA:", bos=True)
    marks = PromptMarks(tokenizer(), gap=8)(text)

    def answered(answer: list[int]) -> Session:  # the prompt fed, then the answer one token a forward, as decoded
        s = Session(model, canonical_chunk=64, canonical_marks=marks)
        s.extend(torch.tensor([text]))
        for token in answer:
            s.extend(torch.tensor([[token]]))
        assert s.state.canonical <= len(text) + 1  # the first token alone is a chunk ending the history there
        return s

    short = ids_of(" yes")
    s = answered(short)
    with forwards(model) as calls:
        assert s.settle(through=text + short) == 0 and calls[0] == 0
    long = ids_of(" it is long,\nand it goes on\nfor lines")
    s = answered(long)
    through = text + long
    assert s.settle(through=through) == 27 and s.state.canonical == len(text) + 27  # the second line's start
    more = torch.tensor([through + ids_of("\nQ: so?\nA:")])
    warm = s.generate(more, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    cold = Session(model, canonical_chunk=64, canonical_marks=marks).generate(
        more, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert s.last_plan.reused == len(text) + 27
    assert torch.equal(warm.sequences, cold.sequences) and torch.equal(torch.cat(warm.logits), torch.cat(cold.logits))


def test_prompt_marks_travel_in_state_files_and_a_malformed_one_is_refused(tmp_path):
    model = model_in("llama")
    text = ids_of("Some text.\nQ: what?\nA:", bos=True)
    marks = PromptMarks(tokenizer(), gap=8)(text)
    s = Session(model, canonical_chunk=16, canonical_marks=marks)
    s.generate(torch.tensor([text]), max_new_tokens=3, do_sample=False)
    s.save(tmp_path / "raw.kvs")
    from kvstate.io import container

    header, tensors = container.read(tmp_path / "raw.kvs")
    assert header["canonical"][3] == list(marks) and marks[0] == PROMPT  # negative: an older reader refuses it
    more = torch.tensor([text + ids_of(" yes\nQ: and?\nA:")])
    loaded = Session.load(tmp_path / "raw.kvs", model)
    assert loaded.state.canonical_marks == marks
    warm = loaded.generate(more, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    cold = Session(model, canonical_chunk=16, canonical_marks=marks).generate(
        more, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert loaded.last_plan.reused == len(text)
    assert torch.equal(warm.sequences, cold.sequences) and torch.equal(torch.cat(warm.logits), torch.cat(cold.logits))
    header = {k: v for k, v in header.items() if k not in ("checksum", "checksums")}
    for bad in ([PROMPT, 8, 2, A], [PROMPT, 0, 0, NL], [PROMPT, 8, 17, *[A] * 17, NL], [PROMPT, 8, 0, 5, 4]):
        with pytest.raises(InputError, match="canonical_marks"):
            Session(model, canonical_marks=bad)
        container.write(tmp_path / "bad.kvs", tensors, {**header, "canonical": [*header["canonical"][:3], bad]})
        with pytest.raises(StateFileError, match="canonical"):
            Session.load(tmp_path / "bad.kvs", model)


QUESTIONS = ("Q: what is wide?\nA:", "Q: and what is blue?\nA:", "Q: the night?\nA:", "Q: and the sea?\nA:")


def _raw_chat(warm_url: str, cold_url: str, model, name: str, text: str, max_tokens: int, server) -> list[tuple]:
    """The raw Q&A over ``/v1/completions``, each request sent as soon as the last answer arrived: per turn the
    prompt, the warm answer, its ``cached_tokens`` and the model forwards its prompt cost (forwards during the
    request less one per decoded token but the first). Each answer's logprobs are the cold server's."""
    from tests.serving import client

    asked = []
    for question in QUESTIONS:
        text += question
        with forwards(model) as calls:
            warm = client(warm_url).completions.create(model=name, prompt=text, max_tokens=max_tokens,
                                                       temperature=0, stop=["\n"], logprobs=2)
        prefill = calls[0] - (warm.usage.completion_tokens - 1)
        cold = client(cold_url).completions.create(model=name, prompt=text, max_tokens=max_tokens, temperature=0,
                                                   stop=["\n"], logprobs=2)
        assert warm.choices[0].logprobs == cold.choices[0].logprobs, f"turn {len(asked) + 1}: warm != cold, bitwise"
        assert warm.choices[0].text == cold.choices[0].text
        asked.append((text, warm.choices[0].text, warm.usage.prompt_tokens_details.cached_tokens, prefill))
        with forwards(model) as idle:
            server.runner.drain()  # the reply's settle, if any, has run
        assert idle[0] == 0, "a settle ran a forward for a reply whose end holds no cut"
        text += warm.choices[0].text + "\n"
    return asked


@pytest.mark.parametrize("max_batch", [1, 4], ids=["one-at-a-time", "batched"])
def test_a_continued_raw_completions_prompt_costs_one_forward_and_answers_as_a_cold_server(max_batch):
    """``/v1/completions`` with no chat template: a Q&A whose client appends the answer and the next question
    to its prompt at once. Each warm request reuses the whole previous prompt, feeds the answer and its own
    tokens in one forward, and answers bit for bit as a server that reuses nothing, and as plain
    ``model.generate``. Before prompt marks each line was a segment: three forwards a turn."""
    from tests.serving import live, make_server, reference

    from kvstate.serve.cli import load

    model, tok = load("tiny:llama")
    warm = make_server(model, tok, canonical_chunk=128, max_batch=max_batch)
    cold = make_server(load("tiny:llama")[0], tok, canonical_chunk=128, max_batch=max_batch, reuse=False)
    text = "The sea is wide.\nThe sky is blue, and the night is dark.\nThe end.\n\n"
    with live(warm) as warm_url, live(cold) as cold_url:
        asked = _raw_chat(warm_url, cold_url, model, "tiny:llama", text, 6, warm)
    oracle = load("tiny:llama")[0]
    for i, (prompt_text, answer, cached, prefill) in enumerate(asked):
        ids = tok(prompt_text).input_ids
        assert answer == reference(oracle, tok, ids, 6, stop=("\n",)), f"turn {i + 1}"
        if i:  # the previous prompt is reused whole; its answer and this turn's tokens are one forward
            assert prefill == 1, f"turn {i + 1}: {prefill} forwards before the first token"
            assert cached == len(tok(asked[i - 1][0]).input_ids), (i, cached)


@pytest.mark.slow
@pytest.mark.default_model
def test_a_raw_qa_on_the_default_model_costs_one_forward_a_turn_bitwise_the_cold_server():
    """The same Q&A on Gemma-3-270M with the server's default schedule (C = 256 on a CPU)."""
    from tests.serving import live, make_server

    from kvstate.serve.cli import load

    model, tok = load("default")
    warm = make_server(model, tok, "gemma-3-270m", canonical_chunk=None)
    cold = make_server(load("default")[0], tok, "gemma-3-270m", canonical_chunk=None, reuse=False)
    text = "".join(f"Fact {i}: the harbour town has {i + 2} bridges and {i * 3 + 1} boats.\n" for i in range(8)) + "\n"
    with live(warm) as warm_url, live(cold) as cold_url:
        asked = _raw_chat(warm_url, cold_url, model, "gemma-3-270m", text, 8, warm)
    for i, (_, _, cached, prefill) in enumerate(asked[1:], 1):
        assert prefill == 1, f"turn {i + 1}: {prefill} forwards before the first token"
        assert cached == len(tok(asked[i - 1][0]).input_ids), (i, cached)
