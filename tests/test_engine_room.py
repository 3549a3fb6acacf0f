"""A decode writes each step's K/V into room reserved for the answer (``kvstate.engine.room``): the buffers keep
their addresses from step to step, as a captured CUDA graph needs, and nothing is concatenated. It must change
no bit: the answer, every step's logits and the state after it equal the decode that concatenates (transformers'
own ``DynamicLayer.update``), in every family and dtype; and the state owns contiguous K/V, no room."""

from __future__ import annotations

import pytest
import torch

from kvstate import Session
from kvstate.engine import room
from tiny import assert_same_state, prompt, tiny_model

FAMILIES = ["llama", "gemma3_text", "qwen3_vl", "lfm2", "mamba"]


def answer(model, history, n=6):
    session = Session(model, canonical_chunk=8)
    session.extend(history[:, :20])
    out = session.generate(history, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                           output_logits=True)
    return out.sequences, torch.cat(out.logits), session.state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_decoding_into_reserved_room_changes_no_bit(arch, dtype, monkeypatch):
    model = tiny_model(arch).to(dtype)
    history = prompt(27)  # past gemma3_text's window: its sliding layers decode over a strided view of the room
    tokens, logits, state = answer(model, history)
    reserved = []
    monkeypatch.setattr(room, "reserve", lambda cache, extra: reserved.append(extra))  # concatenate instead
    plain_tokens, plain_logits, plain_state = answer(model, history)
    assert reserved == [6]  # the room asked for: the answer's tokens
    assert torch.equal(tokens, plain_tokens) and torch.equal(logits, plain_logits)
    assert_same_state(state, plain_state)
    for layer in state.layers:  # the state owns its slots: contiguous, nothing of the room kept alive
        for name, tensor in layer.tensors().items():
            assert tensor.is_contiguous(), (arch, name)
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), (arch, name)


def test_decode_steps_write_into_one_buffer_whose_address_does_not_move(monkeypatch):
    model = tiny_model("llama")
    addresses: list[int] = []
    real = room._Room.append

    def watched(self, keys, values):
        out = real(self, keys, values)
        addresses.append(self.keys.data_ptr())
        return out

    monkeypatch.setattr(room._Room, "append", watched)
    Session(model).generate(prompt(12), max_new_tokens=5, do_sample=False)
    layers = model.config.num_hidden_layers
    assert len(addresses) == 4 * layers  # every decode forward but the first (the prefill's logits) appended
    per_layer = [addresses[i::layers] for i in range(layers)]
    assert all(len(set(steps)) == 1 for steps in per_layer)  # no step moved a buffer
