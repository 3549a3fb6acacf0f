"""Line marks: canonical cuts where a line starts, for text without a chat template (a raw completions prompt).

With ``canonical_marks=kvstate.schedule.lines(ids)`` every token among ``ids`` (the tokens whose text
begins with a line break, ``kvstate.text.line_marks``) starts a segment. A Q&A over a document whose
answer was settled through the prompt and the answer (``Session.settle(through=...)``) then feeds only the
next question's tokens and still answers bit for bit as a cold ``Session`` on the whole text (the oracle: a
new session that shares nothing with the warm one). The cuts are decided by the token at them, so they are
prefix-stable; line marks travel in state files and a reader that predates them refuses such a file. States
made under line marks keep their meaning; ``kvstate serve`` now cuts completions prompts with prompt marks
(``tests/test_schedule_prompt_marks.py``), which cost a cold multi-line prompt a forward a gap of lines, not one a line.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate import Session
from kvstate.errors import InputError, StateFileError
from kvstate.schedule import LINE_SEGMENT, LINES, Canonical, lines
from kvstate.testing.tiny_tokenizer import tiny_tokenizer
from kvstate.text import line_marks
from tiny import prompt, tiny_model

C = 8
NL = 4  # the token that starts a line (the tiny tokenizer's "\n")
MARKS = lines([NL])


@functools.cache
def model_in(arch: str):
    return tiny_model(arch).to(torch.bfloat16)


def line(n: int, seed: int) -> torch.Tensor:
    """A line break, then ``n`` text tokens (ids >= 10: no break inside)."""
    return torch.cat([torch.tensor([[NL]]), prompt(n, seed=seed) % 100 + 10], 1)


def run(session: Session, ids: torch.Tensor, n: int = 5):
    out = session.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.cat(out.logits)


def assert_bitwise(warm, cold, what: str) -> None:
    assert torch.equal(warm[0], cold[0]), f"{what}: tokens {warm[0].tolist()} != {cold[0].tolist()}"
    assert torch.equal(warm[1], cold[1]), f"{what}: per-step logits differ"


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_continued_text_feeds_only_its_new_lines_and_answers_as_the_cold_run(arch):
    """A document of lines, then questions: each answer is settled through the text plus the answer, and the
    next question (a line break, the question, a line break and the answer's prefix) is one or two forwards of
    its own tokens, bitwise the cold run."""
    model = model_in(arch)
    text = torch.cat([prompt(1, seed=0), prompt(20, seed=1) % 100 + 10, line(13, seed=2), line(30, seed=3),
                      line(6, seed=4), line(3, seed=5)], 1)  # BOS, three document lines, "Q: ...", "A:"
    s = Session(model, canonical_chunk=C, canonical_marks=MARKS)
    new = 0
    for turn in range(3):
        warm = run(s, text)
        assert_bitwise(warm, run(Session(model, canonical_chunk=C, canonical_marks=MARKS), text), f"turn {turn}")
        if turn:  # everything before this question was reused
            assert s.last_plan.fed == new and s.last_plan.reused == text.shape[1] - new, (turn, s.last_plan)
        answer = warm[0][:, :3] % 100 + 10  # the answer as the client keeps it: up to the end of its line
        through = torch.cat([text, answer], 1)
        assert s.settle(through=through) > 0 and s.state.tokens_seen == through.shape[1] == s.state.canonical
        question = torch.cat([line(5 + turn, seed=10 + turn), line(2, seed=20 + turn)], 1)
        text, new = torch.cat([through, question], 1), question.shape[1]


def test_line_marks_travel_in_state_files_and_other_marks_start_over(tmp_path):
    model = model_in("llama")
    text = torch.cat([prompt(12, seed=1) % 100 + 10, line(9, seed=2)], 1)
    s = Session(model, canonical_chunk=C, canonical_marks=MARKS)
    run(s, text)
    s.save(tmp_path / "text.kvs")
    from kvstate.io import container

    header, _ = container.read(tmp_path / "text.kvs")
    assert header["canonical"][3] == [LINES, NL]  # negative first: a reader that predates line marks refuses it
    more = torch.cat([text, line(4, seed=3)], 1)
    loaded = Session.load(tmp_path / "text.kvs", model)
    assert loaded.settings.canonical_marks == MARKS and loaded.state.canonical_marks == MARKS
    assert_bitwise(run(loaded, more), run(Session(model, canonical_chunk=C, canonical_marks=MARKS), more), "loaded")
    plain = Session.load(tmp_path / "text.kvs", model, canonical_marks=())
    run(plain, more)
    assert plain.last_plan.reused == 0  # other cuts: none of the file's slots are that schedule's


@pytest.mark.parametrize("bad", [(LINES,), (LINES, 5, 3), (LINES, 4, 4), (LINES, -2), (LINES, *range(5000))])
def test_malformed_line_marks_are_refused(bad, tmp_path):
    with pytest.raises(InputError, match="canonical_marks"):
        Session(model_in("llama"), canonical_marks=bad)
    from kvstate.io import container

    s = Session(model_in("llama"), canonical_chunk=C, canonical_marks=MARKS)
    run(s, line(10, seed=1))
    s.save(tmp_path / "a.kvs")
    header, tensors = container.read(tmp_path / "a.kvs")
    header = {k: v for k, v in header.items() if k not in ("checksum", "checksums")}
    container.write(tmp_path / "b.kvs", tensors, {**header, "canonical": [*header["canonical"][:3], list(bad)]})
    with pytest.raises(StateFileError, match="canonical"):
        Session.load(tmp_path / "b.kvs", model_in("llama"))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.sampled_from([NL, 9, 9, 9, 12]), min_size=1, max_size=90), st.integers(1, 12))
def test_line_cuts_start_every_line_and_are_prefix_stable(history, chunk):
    """A state fed on any prefix holds the whole history's chunks up to where a resume restarts, and every line
    start (a line break at least ``LINE_SEGMENT`` after the previous start) is a cut: the rule written out here."""
    schedule = Canonical(chunk, marks=MARKS)
    full = schedule.cuts(0, len(history), (), history)
    for n in range(1, len(history)):
        pre = schedule.cuts(0, n, (), history[:n])
        assert schedule.keeps(pre[-2] if len(pre) > 1 else 0, n, history[:n]) == n
        restart = schedule.last_cut(n, (), history)
        assert [c for c in pre if c <= restart] == [c for c in full if c <= restart], (n, pre, full)
    starts = [0]
    for p, t in enumerate(history):
        if t == NL and p - starts[-1] >= LINE_SEGMENT:
            starts.append(p)
    expected = set(starts[1:])  # each line start, then chunks of C aligned to it
    for start, end in zip(starts, [*starts[1:], len(history)], strict=True):
        expected |= set(range(start + chunk, end, chunk))
    assert full == [*sorted(expected), len(history)], (full, starts)


def test_line_marks_are_the_tokens_that_start_a_line():
    tokenizer = tiny_tokenizer()
    assert line_marks(tokenizer) == (LINES, tokenizer.convert_tokens_to_ids("\n"))


def test_a_settle_runs_first_only_when_it_moves_the_resume():
    """A request that continues a waiting reply settles it first when the settle's end is a cut of its history
    (the text goes on with a new line), not when the text goes on inside the answer's line (it would be fed
    again anyway)."""
    from kvstate.serve.settle import Unsettled

    text = torch.cat([prompt(12, seed=1) % 100 + 10, line(9, seed=2)], 1)
    s = Session(model_in("llama"), canonical_chunk=C, canonical_marks=MARKS)
    answer = run(s, text, n=4)[0] % 100 + 10
    through = torch.cat([text, answer], 1)[0].tolist()
    entry = Unsettled("ns", s.state, through, MARKS)
    for more, settles in (([NL, 11, 12], True), ([11, 12, NL, 13], False)):
        assert entry.continued_by(through + more) and entry.settles_for(through + more, C) == settles
    assert not entry.continued_by([*through[:-1], 99, NL])


def test_a_settle_runs_no_output_head():
    """A settle recomputes K/V only: every forward it runs gives the head zero rows (on the default model the
    head costs as much as the rest of a short forward, and a request at agent speed waits for the settle),
    and the next question still answers bitwise as the cold run."""
    model = model_in("llama")
    text = torch.cat([prompt(12, seed=1) % 100 + 10, line(9, seed=2)], 1)
    s = Session(model, canonical_chunk=C, canonical_marks=MARKS)
    through = torch.cat([text, run(s, text, n=4)[0] % 100 + 10], 1)
    rows: list[int] = []
    handle = model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: rows.append(out.shape[-2]))
    try:
        assert s.settle(through=through) > 0
    finally:
        handle.remove()
    assert rows and set(rows) == {0} and s.state.last_logits is None, rows
    more = torch.cat([through, line(5, seed=3)], 1)
    assert_bitwise(run(s, more), run(Session(model, canonical_chunk=C, canonical_marks=MARKS), more), "after")


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_history_that_leaves_the_state_where_a_line_starts_reuses_no_slot_of_the_states_running_chunk(arch):
    # a cut is decided by the token at it: a history that shares 5 tokens with the state and then starts a line
    # cuts at 5, where the state's own chunk [0, 8) ran on (found through kvstate serve: a completions prompt
    # after another that shared its first tokens answered with other logprobs than a fresh server)
    model = model_in(arch)
    head = torch.cat([prompt(1, seed=0), prompt(4, seed=1) % 100 + 10], 1)  # BOS and 4 text tokens
    first = torch.cat([head, prompt(10, seed=2) % 100 + 10], 1)  # no line break: one segment, cut at 8
    second = torch.cat([head, line(6, seed=3)], 1)  # a line starts at 5
    warm = Session(model, canonical_chunk=C, canonical_marks=MARKS)
    warm.extend(first)
    assert warm.state.canonical == first.shape[1]
    got = run(warm, second)
    assert warm.last_plan.reused == 0  # 5 is a cut of `second` only
    assert_bitwise(got, run(Session(model, canonical_chunk=C, canonical_marks=MARKS), second), arch)
    again = Session(model, canonical_chunk=C, canonical_marks=MARKS)
    again.extend(torch.cat([head, line(9, seed=4)], 1))  # this state did cut at 5: its slots before are reused
    assert_bitwise(run(again, second), run(Session(model, canonical_chunk=C, canonical_marks=MARKS), second), arch)
    assert again.last_plan.reused == 5
