"""Sessions sharing one model instance are safe across threads.

Two threads each drive their own session on the same model for 20 rounds of a chat
(generate, then the reply and a new turn go back in). Every round's tokens and the
final state equal those of the same conversation run alone, in one thread. RecurrentGemma
keeps its recurrent state on the model's modules and Qwen-VL its ``rope_deltas``, so
without the engine's per-model lock the threads would corrupt each other.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvstate import Session
from kvstate.testing.tiny import image_span, tiny_image
from tiny import assert_same_state, prompt, tiny_model

ROUNDS = 20


def opening(arch, seed):
    if arch == "qwen3_vl":
        pixels, grid, n = tiny_image((4, 6), seed=seed)
        ids = torch.cat([prompt(5, seed=seed), image_span(n), prompt(4, seed=seed + 1)], 1)
        return ids, {"pixel_values": pixels, "image_grid_thw": grid}
    return prompt(12, seed=seed), {}


def chat(model, arch, seed, barrier=None):
    """Run ROUNDS turns; returns (tokens of every round, final state)."""
    session = Session(model)
    history, inputs = opening(arch, seed)
    replies = []
    for turn in range(ROUNDS):
        if barrier is not None:
            barrier.wait()  # both threads start each round together
        # every id is a token: a reply may hold the pad id 0, which generate masks without a mask
        reply = session.generate(history, torch.ones_like(history), max_new_tokens=3, do_sample=False, **inputs)
        replies.append(reply)
        history = torch.cat([history, reply, prompt(2, seed=seed * 100 + turn)], 1)
    return replies, session.state


@pytest.mark.parametrize("arch", ["llama", "qwen3_vl", "recurrent_gemma"])
def test_two_threads_two_sessions_one_model(arch):
    model = tiny_model(arch)
    alone = {seed: chat(model, arch, seed) for seed in (1, 2)}
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def worker(seed):
        try:
            results[seed] = chat(model, arch, seed, barrier)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for seed in (1, 2):
        replies, state = results[seed]
        expected_replies, expected_state = alone[seed]
        assert [r.tolist() for r in replies] == [r.tolist() for r in expected_replies], f"conversation {seed}"
        assert_same_state(state, expected_state)


def test_mamba_scans_in_parallel_threads_on_two_models_and_plain_transformers():
    """kvstate swaps Mamba's scan function only while its runs need it (reference counted); a plain
    transformers forward in a third thread meanwhile still gets transformers' own scan."""
    models = [tiny_model("mamba"), tiny_model("mamba")]
    ids = [prompt(30, seed=s) for s in (1, 2)]
    expected = []
    for model, x in zip(models, ids, strict=True):
        s = Session(model)
        s.extend(x[:, :10])
        expected.append(s.extend(x[:, 10:]))
    plain_model = tiny_model("mamba")
    with torch.no_grad():
        plain_expected = plain_model(ids[0], use_cache=True).logits[:, -1]
    results: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def kvstate_run(i: int) -> None:
        try:
            for _ in range(5):
                s = Session(models[i])
                s.extend(ids[i][:, :10])
                results[f"k{i}"] = s.extend(ids[i][:, 10:])
                assert torch.equal(results[f"k{i}"], expected[i])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    def plain_run() -> None:
        try:
            for _ in range(10):
                with torch.no_grad():
                    assert torch.equal(plain_model(ids[0], use_cache=True).logits[:, -1], plain_expected)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=kvstate_run, args=(i,)) for i in (0, 1)] + [threading.Thread(target=plain_run)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    import transformers.models.mamba.modeling_mamba as mm

    assert getattr(mm.mamba_selective_scan, "__name__", None) != "scan"  # restored after the last run
