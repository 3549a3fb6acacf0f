"""Test helpers: the library's tiny models plus the project tolerance."""

from __future__ import annotations

import torch

from kvstate.testing import assert_logits_close
from kvstate.testing.tiny import CONFIGS, SLIDING, WINDOW, tiny_config, tiny_model
from kvstate.testing.tiny import tiny_prompt as prompt

__all__ = ["CONFIGS", "SLIDING", "WINDOW", "Echo", "assert_logits_close", "assert_same_state", "count_forwards",
           "first_attention_layer", "mute_attention", "prompt", "snapshot", "tiny_config", "tiny_model"]


# ----- helpers shared by the tests ----------------------------------------------------------------
ATTENTION_OUT = ("self_attn.o_proj", "self_attn.out_proj", "temporal_block.o_proj")


def first_attention_layer(model) -> int:
    """Index of the first decoder layer with self-attention."""
    for i, layer in enumerate(model.get_decoder().layers):
        if any(name in ATTENTION_OUT for name, _ in layer.named_modules()):
            return i
    raise ValueError("no attention layer")


def mute_attention(model, index: int):
    """Zero one attention layer's output projection, so what that layer attends to cannot matter.

    Evicting slots from that layer alone then leaves every output of the model unchanged,
    which lets a compressed state be checked against plain ``model.generate`` on the full
    history, option by option (eviction itself is checked against a masked reference in
    test_compress.py).
    """
    layer = model.get_decoder().layers[index]
    projection = next(module for name, module in layer.named_modules() if name in ATTENTION_OUT)
    with torch.no_grad():
        projection.weight.zero_()
        if projection.bias is not None:
            projection.bias.zero_()
    return model


def snapshot(state):
    """A deep copy of a state (shares no memory), to detect any in-place change later."""
    return state.clone()


def assert_same_state(a, b) -> None:
    """Bitwise equality of two states: every tensor, count, checkpoint and extra."""
    assert a.tokens_seen == b.tokens_seen, (a.tokens_seen, b.tokens_seen)
    for name in ("tokens", "mask", "positions", "next_position"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert (a.last_logits is None) == (b.last_logits is None)
    if a.last_logits is not None:
        assert torch.equal(a.last_logits, b.last_logits), "last_logits"
    assert sorted(a.extras) == sorted(b.extras) and all(torch.equal(a.extras[k], b.extras[k]) for k in a.extras)
    assert len(a.layers) == len(b.layers)
    for i, (x, y) in enumerate(zip(a.layers, b.layers, strict=True)):
        assert x.meta() == y.meta(), (i, x.meta(), y.meta())
        tx, ty = x.tensors(), y.tensors()
        assert tx.keys() == ty.keys() and all(torch.equal(tx[k], ty[k]) for k in tx), f"layer {i}"
    assert [c.tokens_seen for c in a.checkpoints] == [c.tokens_seen for c in b.checkpoints]


class Echo:
    """A streamer that records what it is given, as ``model.generate`` hands it out."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


def count_forwards(model):
    """A context manager counting the model's forwards: ``with count_forwards(m) as calls: ...; calls[0]``."""
    import contextlib

    @contextlib.contextmanager
    def counting():
        calls = [0]
        # a global hook, so the model's own hook tables (part of its self-check key) stay as they were
        handle = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda module, _: calls.__setitem__(0, calls[0] + (module is model)))
        try:
            yield calls
        finally:
            handle.remove()

    return counting()


def wait_quiet(model, gap: float = 0.2, timeout: float = 30.0) -> None:
    """Return once ``model`` ran no forward for ``gap`` seconds: a server settles a finished reply on its
    model thread after a short grace (``kvstate.serve.settle.SETTLE_GRACE``), which a test counting the
    forwards of its own next request must not count."""
    import time

    deadline = time.monotonic() + timeout
    with count_forwards(model) as calls:
        seen = -1
        while calls[0] != seen:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the model still runs forwards after {timeout} s")
            seen = calls[0]
            time.sleep(gap)
