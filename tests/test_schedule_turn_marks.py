"""Turn marks: canonical cuts where a chat template starts a user turn.

With ``canonical_marks`` the schedule also cuts where each occurrence of the marks begins, with
the chunks of ``C`` aligned to it. A chat whose answer was settled through the template's
closing tokens (``Session.settle(through=...)``) then feeds only the new turn's tokens, in one
forward, and still answers bit for bit as a cold ``Session`` on the whole history (the oracle:
a new session that shares nothing with the warm one). Also here: the cuts are prefix-stable (a
state fed on a prefix holds the cold run's chunks up to where a resume keeps it), marks travel in
state files, and ``turn_marks`` finds a template's user-turn prefix.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstate import Session
from kvstate.errors import InputError, StateFileError
from kvstate.schedule import MIN_SEGMENT, Canonical
from kvstate.serve.chat import FALLBACK_TEMPLATE
from kvstate.testing.tiny import RECURRENT
from kvstate.testing.tiny_tokenizer import tiny_tokenizer
from kvstate.text import turn_marks
from tiny import prompt, tiny_model

C = 8
MARKS = (3, 4)  # a two-token "user turn" prefix
CLOSE = (5,)  # what the template writes after an answer (not a mark: the next mark follows it)


@functools.cache
def model_in(arch: str):
    return tiny_model(arch).to(torch.bfloat16)


def user_turn(n: int, seed: int) -> torch.Tensor:
    """The marks, then ``n`` message tokens (ids >= 10, so no mark inside)."""
    return torch.cat([torch.tensor([MARKS]), prompt(n, seed=seed) % 100 + 10], 1)


def run(session: Session, ids: torch.Tensor, n: int = 5):
    out = session.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.cat(out.logits)


def skip_stepwise(model, arch: str) -> None:
    """lfm2 continues one token per forward on transformers 5.14: no canonical schedule there."""
    from kvstate.selfcheck import bind

    if bind(model).caps.stepwise:
        pytest.skip(f"{arch} continues one token per forward: no canonical schedule (docs/exactness.md)")


def assert_bitwise(warm, cold, what: str) -> None:
    assert torch.equal(warm[0], cold[0]), f"{what}: tokens {warm[0].tolist()} != {cold[0].tolist()}"
    assert torch.equal(warm[1], cold[1]), f"{what}: per-step logits differ"


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_a_settled_chat_turn_feeds_only_its_own_tokens_and_answers_as_the_cold_run(arch):
    model = model_in(arch)
    skip_stepwise(model, arch)
    chat = torch.cat([prompt(1, seed=0), prompt(11, seed=1) % 100 + 10, user_turn(13, seed=2)], 1)  # BOS, system
    s = Session(model, canonical_chunk=C, canonical_marks=MARKS)
    new = 0
    for turn in range(4):
        warm = run(s, chat)
        assert_bitwise(warm, run(Session(model, canonical_chunk=C, canonical_marks=MARKS), chat), f"turn {turn}")
        if turn:  # everything before this turn's mark was reused: one forward of the turn's own tokens
            assert s.last_plan.fed == new, (turn, s.last_plan)
        through = torch.cat([chat, warm[0], torch.tensor([CLOSE])], 1)  # the answer as the template renders it
        fed = s.settle(through=through)
        assert fed > 0 and s.state.tokens_seen == through.shape[1] == s.state.canonical
        new = 6 + 3 * turn + len(MARKS)
        chat = torch.cat([through, user_turn(new - len(MARKS), seed=10 + turn)], 1)


def test_without_the_closing_tokens_the_turn_refeeds_from_the_last_cut():
    """The control: a settle that stops at the answer's own end leaves no cut where the next mark begins,
    so the next turn feeds again from the last cut before it (still bitwise the cold run)."""
    model = model_in("llama")
    chat = torch.cat([prompt(12, seed=1) % 100 + 10, user_turn(13, seed=2)], 1)
    s = Session(model, canonical_chunk=C, canonical_marks=MARKS)
    answer = run(s, chat)[0]
    s.settle()
    turn2 = torch.cat([chat, answer, torch.tensor([CLOSE]), user_turn(4, seed=3)], 1)
    assert_bitwise(run(s, turn2), run(Session(model, canonical_chunk=C, canonical_marks=MARKS), turn2), "turn 2")
    assert s.last_plan.fed > 4 + len(MARKS) + len(CLOSE)


def test_marks_travel_in_state_files_and_another_schedule_starts_over(tmp_path):
    model = model_in("gemma3_text")
    chat = torch.cat([prompt(12, seed=1) % 100 + 10, user_turn(9, seed=2)], 1)
    s = Session(model, canonical_chunk=C, canonical_marks=MARKS)
    answer = run(s, chat)[0]
    through = torch.cat([chat, answer, torch.tensor([CLOSE])], 1)
    s.settle(through=through)
    s.save(tmp_path / "chat.kvs")
    turn2 = torch.cat([through, user_turn(5, seed=3)], 1)
    cold = run(Session(model, canonical_chunk=C, canonical_marks=MARKS), turn2)
    loaded = Session.load(tmp_path / "chat.kvs", model)
    assert loaded.settings.canonical_marks == MARKS and loaded.state.canonical_marks == MARKS
    assert_bitwise(run(loaded, turn2), cold, "loaded")
    assert loaded.last_plan.fed == 5 + len(MARKS)
    plain = Session.load(tmp_path / "chat.kvs", model, canonical_marks=())  # other cuts: none of its slots count
    assert_bitwise(run(plain, turn2), run(Session(model, canonical_chunk=C), turn2), "other schedule")
    assert plain.last_plan.reused == 0


def test_the_default_chunk_holds_a_turn_with_marks_and_a_short_tail_without(tmp_path):
    """C defaults to 256 with marks (a turn starts on a cut, so C only has to hold the turn) and to 64 without
    (every turn re-feeds the tail since the last multiple of C); a loaded state keeps its own C."""
    from kvstate.batch import Scheduler, batch_settings
    from kvstate.schedule import MARKED_CHUNK, POSITION_CHUNK

    model = model_in("llama")
    assert (MARKED_CHUNK, POSITION_CHUNK) == (256, 64)
    assert Session(model).canonical_chunk == 64 and Session(model, canonical_marks=MARKS).canonical_chunk == 256
    assert Session(model, canonical_chunk=C, canonical_marks=MARKS).canonical_chunk == C
    assert Scheduler(model, batch_settings(model, canonical_marks=MARKS)).canonical_chunk == 256
    assert Scheduler(model).canonical_chunk == 64
    s = Session(model, canonical_marks=MARKS)
    turn = user_turn(200, seed=4)  # 202 tokens: one forward at C = 256, as the cold run
    run(s, turn)
    assert s.state.canonical_chunk == 256 and s.last_plan.fed == 202
    s.save(tmp_path / "chat.kvs")
    assert Session.load(tmp_path / "chat.kvs", model).canonical_chunk == 256
    assert Session.load(tmp_path / "chat.kvs", model, canonical_marks=()).canonical_chunk == 256  # the file's C


def test_the_server_takes_256_with_the_templates_marks_and_64_without():
    from kvstate.serve import Server, Settings
    from kvstate.serve.cli import load

    model, tokenizer = load("tiny:llama")
    marked, plain = Server(model, tokenizer, "t"), Server(model, tokenizer, "t", Settings(turn_marks=False))
    assert marked.marks and (marked.canonical_chunk, marked.runner.settings.canonical_chunk) == (256, 256)
    assert not plain.marks and (plain.canonical_chunk, plain.runner.settings.canonical_chunk) == (64, 64)
    off = Server(model, tokenizer, "t", Settings(canonical_chunk=0))
    assert off.runner.settings.canonical_chunk == 0
    for server in (marked, plain, off):
        server.close()


def test_malformed_marks_are_refused():
    with pytest.raises(InputError, match="canonical_marks"):
        Session(model_in("llama"), canonical_marks=["user"])
    with pytest.raises(InputError, match="canonical_marks"):
        Session(model_in("llama"), canonical_marks=(-1,))


def test_a_file_with_malformed_marks_is_refused(tmp_path):
    from kvstate.io import container

    s = Session(model_in("llama"), canonical_chunk=C, canonical_marks=MARKS)
    run(s, user_turn(10, seed=1))
    s.save(tmp_path / "a.kvs")
    header, tensors = container.read(tmp_path / "a.kvs")
    assert header["canonical"][3] == list(MARKS)
    header = {k: v for k, v in header.items() if k not in ("checksum", "checksums")}
    for bad in ([], ["x"], [1 << 40]):
        container.write(tmp_path / "b.kvs", tensors, {**header, "canonical": [*header["canonical"][:3], bad]})
        with pytest.raises(StateFileError, match="canonical"):
            Session.load(tmp_path / "b.kvs", model_in("llama"))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([3, 4, 9, 9, 9]), min_size=1, max_size=90), st.integers(1, 12))
def test_the_cuts_are_prefix_stable(history, chunk):
    """A state fed on any prefix in canonical chunks, and cut back where a resume of the whole history
    restarts, holds exactly the whole history's chunks up to there."""
    schedule = Canonical(chunk, marks=MARKS)
    full = schedule.cuts(0, len(history), (), history)
    for n in range(1, len(history)):
        pre = schedule.cuts(0, n, (), history[:n])
        kept = schedule.keeps(pre[-2] if len(pre) > 1 else 0, n, history[:n])
        restart = schedule.last_cut(kept, (), history)
        assert [c for c in pre if c <= restart] == [c for c in full if c <= restart], (n, pre, full, kept)
    marks_at = [p for p in range(1, len(history) - 1) if history[p:p + 2] == list(MARKS)]
    assert all(p in full for p in marks_at if p >= MIN_SEGMENT and all(p - q >= MIN_SEGMENT
                                                                      for q in marks_at if q < p)) or chunk


def test_turn_marks_finds_the_templates_user_turn_prefix():
    tokenizer = tiny_tokenizer()
    marks = turn_marks(tokenizer, FALLBACK_TEMPLATE)
    assert tokenizer.decode(list(marks)) == "User: "


def test_recurrent_families_settle_through_a_checkpoint_at_the_cut():
    """Hybrid recurrent layers are checkpointed at cuts: a settled chat rolls back to the mark exactly."""
    arch = next(a for a in RECURRENT if a == "lfm2")
    model = model_in(arch)
    skip_stepwise(model, arch)
    chat = torch.cat([prompt(10, seed=1) % 100 + 10, user_turn(9, seed=2)], 1)
    s = Session(model, canonical_chunk=C, canonical_marks=MARKS)
    answer = run(s, chat)[0]
    through = torch.cat([chat, answer, torch.tensor([CLOSE])], 1)
    s.settle(through=through)
    branch = s.fork()
    turn2 = torch.cat([through, user_turn(4, seed=3)], 1)
    run(s, turn2)
    other = torch.cat([through, user_turn(6, seed=4)], 1)  # another second turn, from the fork
    assert_bitwise(run(branch, other), run(Session(model, canonical_chunk=C, canonical_marks=MARKS), other), "fork")
    assert branch.last_plan.fed == 6 + len(MARKS)


@pytest.mark.parametrize("max_batch", [1, 4], ids=["one-at-a-time", "batched"])
def test_a_served_chat_reuses_everything_before_the_new_user_turn(max_batch):
    """``kvstate serve`` finds the template's turn marks and settles each answer through the template's
    closing tokens: the next turn's ``cached_tokens`` is all of its history before the new user message,
    and every answer is plain ``model.generate``'s on the rendered history."""
    from tests.serving import chat_turn, client, live, make_server, reference

    from kvstate.serve.cli import load

    model, tokenizer = load("tiny:llama")
    server = make_server(model, tokenizer, max_batch=max_batch)
    assert server.marks and tokenizer.decode(list(server.marks)) == "User: "
    messages, settled = [{"role": "system", "content": "You are terse."}], None
    with live(server) as url:
        api = client(url)
        for i, question in enumerate(["Hi there!", "What is the sea?", "And the sky, at night?"]):
            messages.append({"role": "user", "content": question})
            prompt = server.renderer.chat(messages)
            answer, cached = chat_turn(api, messages, stream=bool(i % 2), max_tokens=12)
            # the settle runs on the model thread after the reply; the reference waits for it (kvstate's forwards
            # switch the model's attention implementation while they run: docs/batching.md)
            server.runner.drain()
            assert answer == reference(model, tokenizer, prompt.ids, 12), f"turn {i + 1}"
            if settled is not None:
                assert prompt.ids[:len(settled)] == settled and cached == len(settled), (i, cached, len(settled))
            messages.append({"role": "assistant", "content": answer})
            settled = server.renderer.following(prompt, answer)


@pytest.mark.parametrize("max_batch", [1, 4], ids=["one-at-a-time", "batched"])
def test_a_request_sent_while_a_settle_waits_runs_first_and_the_settle_is_kept(max_batch, monkeypatch):
    """A settle waits ``SETTLE_GRACE`` for a request before it runs (here 60 s, so the order is certain): another
    chat's request sent right after a reply runs at once, and the reply is settled later, when the model is idle
    again, so its chat's next turn still reuses everything before the new user message."""
    from tests.serving import chat_turn, client, live, make_server, reference

    from kvstate.serve import settle
    from kvstate.serve.cli import load

    monkeypatch.setattr(settle, "SETTLE_GRACE", 60.0)
    model, tokenizer = load("tiny:llama")
    server = make_server(model, tokenizer, max_batch=max_batch)
    chats = {name: [{"role": "user", "content": f"I am {name}. Where is the sea?"}] for name in ("Ada", "Ben")}
    with live(server) as url:
        api = client(url)
        prompts = {}
        for name, messages in chats.items():  # Ben's request arrives while Ada's settle waits its grace
            prompts[name] = server.renderer.chat(messages)
            answer, _ = chat_turn(api, messages, stream=False, max_tokens=8)
            assert answer == reference(model, tokenizer, prompts[name].ids, 8)
            messages.append({"role": "assistant", "content": answer})
        assert len(server.runner.settler.waiting) == 2  # neither settled yet: the model thread waits for a request
        monkeypatch.setattr(settle, "SETTLE_GRACE", 0.0)
        server.runner._arrived.set()  # end the 60 s wait (the settles are kept), then run them with no grace
        server.runner._executor.submit(server.runner.settler.settle_idle).result()
        assert not server.runner.settler.waiting
        for name, messages in chats.items():
            settled = server.renderer.following(prompts[name], messages[-1]["content"])
            messages.append({"role": "user", "content": "And the sky?"})
            prompt = server.renderer.chat(messages)
            answer, cached = chat_turn(api, messages, stream=True, max_tokens=8)
            server.runner.drain()  # the reply's settle (no grace now) runs before the plain reference
            assert answer == reference(model, tokenizer, prompt.ids, 8)
            assert prompt.ids[:len(settled)] == settled and cached == len(settled), (name, cached, len(settled))
    server.close()


@pytest.mark.parametrize("max_batch", [1, 4], ids=["one-at-a-time", "batched"])
def test_a_client_that_never_pauses_reuses_as_much_as_one_that_pauses(max_batch, monkeypatch):
    """An agent sends its next turn as soon as a reply arrives. Here the idle settle never comes first
    (``SETTLE_GRACE`` 60 s: the next request always arrives while it waits), so each request settles its own
    conversation's last reply before it runs: every turn reuses everything before its new user message, as
    with a pause (``test_a_served_chat_reuses_everything_before_the_new_user_turn``), and every answer is
    plain ``model.generate``'s on the rendered history (on another instance of the model)."""
    from tests.serving import chat_turn, client, live, make_server, reference

    from kvstate.serve import settle
    from kvstate.serve.cli import load

    monkeypatch.setattr(settle, "SETTLE_GRACE", 60.0)
    model, tokenizer = load("tiny:llama")
    server = make_server(model, tokenizer, max_batch=max_batch)
    messages, turns = [{"role": "system", "content": "You are terse."}], []
    with live(server) as url:
        api = client(url)
        for i, question in enumerate(["Hi there!", "What is the sea?", "And the sky, at night?", "Why?"]):
            messages.append({"role": "user", "content": question})
            prompt = server.renderer.chat(messages)
            answer, cached = chat_turn(api, messages, stream=bool(i % 2), max_tokens=12)
            turns.append((prompt, answer, cached))
            messages.append({"role": "assistant", "content": answer})
    oracle = load("tiny:llama")[0]
    for i, (prompt, answer, cached) in enumerate(turns):
        assert answer == reference(oracle, tokenizer, prompt.ids, 12), f"turn {i + 1}"
        if i:
            settled = server.renderer.following(*turns[i - 1][:2])
            assert prompt.ids[:len(settled)] == settled and cached == len(settled), (i, cached, len(settled))


def test_a_waiting_settle_lets_go_of_a_state_the_pool_evicted(monkeypatch):
    """A settle kept for later holds its state only while the pool does: once the pool evicts it, the runner drops
    it too (``Settler.forget_unpooled``, before every settling pass), so waiting settles never keep K/V past the pool's
    byte budget."""
    from tests.serving import chat_turn, client, live, make_server

    from kvstate.serve.cli import load
    from kvstate.serve.settle import Settler

    monkeypatch.setattr(Settler, "settle_idle", lambda self: None)  # the settles wait; nothing races the checks
    model, tokenizer = load("tiny:llama")
    server = make_server(model, tokenizer)
    with live(server) as url:
        api = client(url)
        chat_turn(api, [{"role": "user", "content": "I am Ada."}], stream=False, max_tokens=8)
        namespace, ada = server.runner.settler.waiting[-1].namespace, server.runner.settler.waiting[-1].state
        server.pool.max_bytes = ada.nbytes * 3 // 2  # room for one such state: the next reply evicts Ada's
        chat_turn(api, [{"role": "user", "content": "I am Ben."}], stream=False, max_tokens=8)
        ben = server.runner.settler.waiting[-1].state
        assert len(server.runner.settler.waiting) == 2
        assert server.pool.holds(namespace, ben) and not server.pool.holds(namespace, ada)
        server.runner._executor.submit(server.runner.settler.forget_unpooled).result()  # on the model thread
        assert len(server.runner.settler.waiting) == 1 and server.runner.settler.waiting[0].state is ben
