"""A failure at any stage leaves the state exactly as it was.

Faults are planted at every stage of ``generate`` and ``extend``: validation,
planning, each forward of the prefill (chunk by chunk), each decoding step inside
``model.generate``, the streamer, a logits processor, and the store's read and
write; as ordinary exceptions and as ``KeyboardInterrupt``. After each, the state
is bitwise equal to a deep copy taken before the call (and to a fork taken then),
no hook is left on the model, and continuing equals a fresh run. The state before
each call holds tokens the history does not share, so the call must roll back:
the old ``generate`` cut the state before running and lost that tail on a failure.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import kvstate.resume
from kvstate import PrefixStore, Session
from kvstate.errors import MaskError, StoreWarning
from kvstate.testing.tiny import IMAGE_TOKEN, image_span, tiny_image
from tiny import Echo, assert_same_state, count_forwards, prompt, snapshot, tiny_model

ARCHS = ["llama", "gemma3_text", "qwen3_vl", "lfm2", "recurrent_gemma"]
N = 5


class Fault(Exception):
    """The planted failure."""


def conversation(arch):
    if arch == "qwen3_vl":
        pixels, grid, n = tiny_image((4, 6), seed=3)
        ids = torch.cat([prompt(8, seed=5), image_span(n), prompt(14, seed=6)], 1)
        return ids, {"pixel_values": pixels, "image_grid_thw": grid}
    return prompt(30, seed=5), {}


class Case:
    """A session whose state holds history[:split] plus 5 tokens the history does not share."""

    def __init__(self, arch):
        self.model = tiny_model(arch)
        self.history, self.inputs = conversation(arch)
        self.split = self.history.shape[1] - 7
        base = Session(self.model, chunk_size=3)
        base.extend(self.history[:, :self.split], **self.inputs)
        base.extend(prompt(5, seed=9))
        self.base = base
        extra = {**self.inputs, "mm_token_type_ids": (self.history == IMAGE_TOKEN).int()} if self.inputs else {}
        self.reference = self.model.generate(self.history, attention_mask=torch.ones_like(self.history),
                                             max_new_tokens=N, do_sample=False, **extra)[:, self.history.shape[1]:]

    def generate(self, session, **kwargs):
        return session.generate(self.history, max_new_tokens=N, do_sample=False, **self.inputs, **kwargs)

    def check_unchanged(self, session, before, fork, what):
        assert_same_state(session.state, before)
        assert_same_state(fork.state, before)  # a fork taken before the call is untouched too
        model = self.model
        assert not model._forward_hooks and not model._forward_pre_hooks, f"{what}: a hook outlived the call"
        assert "_prefill" not in vars(model), f"{what}: generate's prefill was left replaced"
        assert torch.equal(self.generate(session), self.reference), f"{what}: continuing differs from a fresh run"


@contextlib.contextmanager
def raise_on_forward(model, k, error):
    """Raise ``error`` when the model's ``k``-th forward (0-based) starts."""
    calls = [0]

    def hook(*_):
        calls[0] += 1
        if calls[0] - 1 == k:
            raise error

    handle = model.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


class RaisingStreamer(Echo):
    def __init__(self, at, error):
        super().__init__()
        self.at, self.error = at, error

    def put(self, value):
        if len(self.puts) == self.at:
            raise self.error
        super().put(value)

    def end(self):
        if self.at == "end":
            raise self.error


@pytest.fixture(scope="module", params=ARCHS)
def case(request):
    return Case(request.param)


def forwards_of(case, **kwargs):
    s = case.base.fork()
    with count_forwards(case.model) as calls:
        case.generate(s, **kwargs)
    return calls[0]


@pytest.mark.parametrize("error", [Fault("boom"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
def test_a_fault_in_any_forward_of_generate_changes_nothing(case, error):
    total = forwards_of(case)
    assert total >= 4  # prefill chunks plus decoding steps
    for k in range(total):
        session = case.base.fork()
        fork, before = session.fork(), snapshot(session.state)
        with raise_on_forward(case.model, k, error), pytest.raises(type(error)):
            case.generate(session)
        case.check_unchanged(session, before, fork, f"forward {k} of {total}")


def test_validation_planning_streamer_and_processor_faults_change_nothing(case, monkeypatch):
    from transformers import LogitsProcessor, LogitsProcessorList

    class RaiseAt(LogitsProcessor):
        def __init__(self, step):
            self.step, self.seen = step, 0

        def __call__(self, input_ids, scores):
            self.seen += 1
            if self.seen - 1 == self.step:
                raise Fault("processor")
            return scores

    faults = {"validation": (lambda s: s.generate(case.history, attention_mask=torch.ones(1, 3)), MaskError)}
    for at in [*range(N + 1), "end"]:
        faults[f"streamer put {at}"] = (lambda s, at=at: case.generate(s, streamer=RaisingStreamer(at, Fault())),
                                        Fault)
    for step in range(N):
        faults[f"processor step {step}"] = (
            lambda s, step=step: case.generate(s, logits_processor=LogitsProcessorList([RaiseAt(step)])), Fault)
    for name, (call, error) in faults.items():
        session = case.base.fork()
        fork, before = session.fork(), snapshot(session.state)
        with pytest.raises(error):
            call(session)
        case.check_unchanged(session, before, fork, name)
    with monkeypatch.context() as patch:
        patch.setattr(kvstate.resume, "plan", lambda *a, **k: (_ for _ in ()).throw(Fault("planner")))
        session = case.base.fork()
        fork, before = session.fork(), snapshot(session.state)
        with pytest.raises(Fault):
            case.generate(session)
    case.check_unchanged(session, before, fork, "planning")


@pytest.mark.parametrize("error", [Fault("boom"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
def test_a_fault_in_any_chunk_of_extend_changes_nothing(case, error):
    more = prompt(8, seed=11)
    s = case.base.fork()
    with count_forwards(case.model) as calls:
        s.extend(more)
    expected = s.state
    for k in range(calls[0]):
        session = case.base.fork()
        fork, before = session.fork(), snapshot(session.state)
        with raise_on_forward(case.model, k, error), pytest.raises(type(error)):
            session.extend(more)
        assert_same_state(session.state, before)
        assert_same_state(fork.state, before)
        session.extend(more)
        assert_same_state(session.state, expected)  # the retry equals an undisturbed call


class BrokenStore:
    """A store whose reads and writes fail as configured."""

    chunk_tokens = 8

    def __init__(self, read=None, write=None):
        self.read, self.write = read, write

    def lookup(self, query, *, longer_than, at_most):
        if self.read:
            raise self.read
        return None

    def offer(self, states, query, seconds_per_token=0.0):
        if self.write:
            raise self.write
        return 0


def test_store_failures_never_lose_the_answer(case):
    for store in (BrokenStore(read=OSError("disk gone")), BrokenStore(write=OSError("disk full")),
                  BrokenStore(read=ConnectionError("redis down"), write=ConnectionError("redis down"))):
        session = Session(case.model, chunk_size=3, store=store, state=case.base.state)
        clean = Session(case.model, chunk_size=3, state=case.base.state,
                        checkpoint_every=session.settings.checkpoint_every)
        with pytest.warns(StoreWarning):
            tokens = case.generate(session)
        assert torch.equal(tokens, case.reference)
        assert torch.equal(tokens, case.generate(clean))
        assert_same_state(session.state, clean.state)  # the answer and the new state are kept


def test_ctrl_c_while_the_store_writes_changes_nothing(case):
    session = Session(case.model, chunk_size=3, store=BrokenStore(write=KeyboardInterrupt()),
                      state=case.base.state)
    fork, before = session.fork(), snapshot(session.state)
    with pytest.raises(KeyboardInterrupt):
        case.generate(session)
    session.store = None
    case.check_unchanged(session, before, fork, "store write, ctrl-c")


def test_a_prefix_store_with_a_failing_backend_degrades_and_counts(tmp_path, monkeypatch):
    model = tiny_model("llama")
    ids = prompt(40)
    store = PrefixStore(tmp_path / "store", chunk_tokens=8)
    monkeypatch.setattr(store.backend, "get", lambda key: (_ for _ in ()).throw(OSError("read failed")))
    monkeypatch.setattr(store.backend, "put", lambda *a: (_ for _ in ()).throw(OSError("write failed")))
    s = Session(model, store=store)
    Session(model, store=PrefixStore(tmp_path / "other", chunk_tokens=8)).generate(ids, max_new_tokens=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = s.generate(ids, max_new_tokens=N, do_sample=False)
    assert sum(issubclass(w.category, StoreWarning) for w in caught) == 2  # the read and the write
    assert torch.equal(tokens, model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                              do_sample=False)[:, 40:])
    assert store.stats()["failures"] == 2
