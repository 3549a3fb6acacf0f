"""Per-head compression: every policy, on every registered family with attention layers, continues exactly
as attention restricted, per KV head, to that head's retained slots, in float32 and bfloat16.

The oracle is built here, apart from kvstate's masks and packing. From the *uncompressed* state it takes each
attention layer's K/V, gathers for every KV head the tokens the compressed state says that head kept (token
order, right-aligned, zero K/V in front: the layout docs/state-file.md gives a per-head layer), puts them in
the model's cache (the recurrent parts as the uncompressed state holds them), and runs plain transformers on
the continuation with a mask per query head written here from the slots' positions. Same shapes, same
kernels, so the logits must be bitwise equal in both dtypes; anything kvstate got wrong (a slot, a position,
a head's group, the padding, a sliding window's cut) changes them.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kvstate import Session
from kvstate.compress import (
    TOVA,
    ChunkKV,
    ExpectedAttention,
    Keep,
    KNorm,
    KVzip,
    PerLayerBudget,
    Random,
    SnapKV,
    StreamingLLM,
)
from kvstate.layers import AttentionLayerState, attention_of
from tiny import WINDOW, prompt, tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
POLICIES = {
    "streaming": lambda: StreamingLLM(0.5, sinks=2),
    "knorm": lambda: KNorm(0.5),
    "random": lambda: Random(0.5, seed=3),
    "tova": lambda: TOVA(0.5),
    "snapkv": lambda: SnapKV(0.5, window=4, kernel=3),
    "snapkv-heads": lambda: SnapKV(0.5, window=4, kernel=3, heads=True),
    # one ranking; on the hybrid the sliding layers keep their floors alone and the full layers the rest
    "snapkv-hybrid": lambda: SnapKV(0.75, window=4, kernel=3, scope="global", sliding="recent", floor=0.2),
    "pyramid": lambda: PerLayerBudget(0.5, policy=KNorm()),
    "kvzip": lambda: KVzip(0.5, chunk=16),  # the reference method: per head, one ranking; two re-read chunks
    "kvzip_plus": lambda: KVzip(0.5, normalize=True),
    # the question-agnostic hybrid rule: each sliding head's floor its best-scored slots, the rest its newest
    "kvzip-hybrid": lambda: KVzip(0.5, chunk=16, sliding="recent", floor=0.2),
    "kvzip_earlier": lambda: KVzip(0.5, prompt=(5, 6), softmax="model", heads=False, scope="layer"),
    "expected": lambda: ExpectedAttention(0.5, future=16),
    "expected_window": lambda: ExpectedAttention(0.5, window=4, future=16, heads=False, scope="layer"),
    "chunkkv": lambda: ChunkKV(policy=KVzip(0.5), chunk=3),
    "keep": lambda: Keep({1: [[0, 1, 2, 9], [0, 5, 6, 7, 10]], 2: [[3], list(range(0, 36, 2))]}),  # slot indices
}
# every registered family with attention (falcon_h1's sits in hybrid layers, beside its Mamba mixer; mamba,
# mamba2, xlstm and rwkv have none)
FAMILIES = ["llama", "qwen3", "qwen2", "mistral", "gemma2", "gemma3_text", "lfm2", "qwen3_next", "jamba",
            "falcon_h1", "recurrent_gemma", "minimax", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3"]
T = 3 * WINDOW


@functools.cache
def model_in(arch: str, dtype: str):
    return tiny_model(arch).to(DTYPES[dtype])


def kept_tokens(state, layer: AttentionLayerState, head: int) -> list[int]:
    """Token indices one KV head of a compressed layer holds, in slot order (positions unique per token)."""
    slots = layer.positions[0, head] if layer.per_head else layer.positions[0]
    track = state.positions[0]
    if track.dim() == 1:
        return [int(p) for p in slots if int(p) >= 0]
    return [int((track == p).all(-1).nonzero()[0]) for p in slots if int(p[0]) >= 0]


class Oracle:
    """Plain transformers over the test's own cache and masks (see the module docstring)."""

    def __init__(self, session: Session, full, compressed) -> None:
        self.model, self.binding = session.model, session._binding
        self.config = self.model.config.get_text_config(decoder=True)
        self.state = full
        self.context = self.binding.runtime.attached(full)
        self.cache = self.context.__enter__().cache
        self.keys: dict[int, torch.Tensor] = {}  # per attention layer: [H, K(, R)] positions of its dense slots
        self.windows: dict[int, int | None] = {}
        for i, layer in enumerate(map(attention_of, compressed.layers)):  # a hybrid layer's attention part too
            whole = attention_of(full.layers[i])
            if layer is not None and layer.keys is not None and whole is not None and whole.keys is not None:
                self._pack(i, whole, layer, compressed)

    def _pack(self, i: int, whole: AttentionLayerState, small: AttentionLayerState, compressed) -> None:
        H = whole.keys.shape[1]
        heads = [kept_tokens(compressed, small, h) for h in range(H)]
        width = max(len(h) for h in heads)
        first = self.state.tokens_seen - whole.keys.shape[2]  # token of the uncompressed layer's slot 0
        keys = whole.keys.new_zeros(1, H, width, whole.keys.shape[3])
        values = whole.values.new_zeros(1, H, width, whole.values.shape[3])
        pos_shape = (H, width, *self.state.positions.shape[2:])
        positions = torch.full(pos_shape, -1, dtype=torch.long)
        for h, tokens in enumerate(heads):
            at = width - len(tokens)
            keys[0, h, at:] = whole.keys[0, h, [t - first for t in tokens]]
            values[0, h, at:] = whole.values[0, h, [t - first for t in tokens]]
            positions[h, at:] = self.state.positions[0, tokens]
        self.cache.layers[i].keys, self.cache.layers[i].values = keys, values
        self.keys[i], self.windows[i] = positions, whole.window

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """Last logits ``[1, V]`` after feeding ``ids`` ``[1, Q]`` (in one forward, or one token per forward
        where the family's continuation needs it)."""
        stepwise = self.binding.caps.stepwise
        pieces = [ids[:, j:j + 1] for j in range(ids.shape[1])] if stepwise else [ids]
        for piece in pieces:
            logits = self._forward(piece)
        return logits

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        inputs = self.binding.runtime.forward_inputs(self.state.tokens, ids, {})
        mask = torch.ones(1, self.state.tokens_seen + ids.shape[1], dtype=torch.bool)
        positions = self.binding.inputs.positions(self.state.next_position, ids, mask[:, -ids.shape[1]:], inputs)
        kwargs = dict(inputs, input_ids=ids, use_cache=True, **{self.binding.runtime.cache_kwarg: self.cache})
        if self.binding.caps.position_ids:
            kwargs["position_ids"] = self.binding.runtime.model_positions(positions)
        if self.binding.caps.logits_to_keep:
            kwargs["logits_to_keep"] = 1
        layers = self.model.get_decoder().layers
        hooks = [layers[i].register_forward_pre_hook(self._hook(i, positions[0]), with_kwargs=True)
                 for i in self.keys]
        try:  # the family's own plumbing around a forward (module-held recurrent states, scans)
            with torch.no_grad(), self.binding.runtime.forward_context():
                logits = self.model(**kwargs).logits[:, -1]
        finally:
            for h in hooks:
                h.remove()
        self.state = _advanced(self.state, ids, positions)
        return logits

    def _hook(self, i: int, new: torch.Tensor):
        H = self.keys[i].shape[0]
        self.keys[i] = torch.cat([self.keys[i], new[None].expand(H, *new.shape)], dim=1)
        keys, window, Q = self.keys[i], self.windows[i], new.shape[0]
        if window is not None:
            keys = keys[:, -(window - 1 + Q):]
        K = keys.shape[1]
        if keys.dim() == 2:  # 1-D positions: causal by position, inside the window, never padding
            visible = (keys[:, None, :] <= new[None, :, None]) & (keys[:, None, :] >= 0)
            if window is not None:
                visible &= new[None, :, None] - keys[:, None, :] < window
        else:  # M-RoPE: every held slot, and the new ones causal by index
            causal = torch.ones(Q, Q, dtype=torch.bool).tril()
            visible = torch.cat([(keys[:, None, :K - Q, 0] >= 0).expand(H, Q, K - Q), causal.expand(H, Q, Q)], -1)
        mask = visible.repeat_interleave(self.config.num_attention_heads // H, dim=0)[None]

        def hook(_module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            if self.config._attn_implementation != "sdpa":
                form = torch.zeros(mask.shape, dtype=hidden.dtype).masked_fill(~mask, torch.finfo(hidden.dtype).min)
            else:
                form = mask
            if "attention_mask" in kwargs or not args:
                return args, {**kwargs, "attention_mask": form}
            return (args[0], args[1], form, *args[3:]), kwargs  # RecurrentGemma: (activations, positions, mask)

        return hook


def _advanced(state, ids, positions):
    from dataclasses import replace

    return replace(state, tokens=torch.cat([state.tokens, ids], 1),
                   positions=torch.cat([state.positions, positions], 1), next_position=positions.flatten(1).amax(1) + 1)


def check(arch: str, dtype: str, policy, steps: int = 2) -> Session:
    """Compress a context, then continue it by a chunk and ``steps`` decode steps, each bitwise against the
    oracle."""
    s = Session(model_in(arch, dtype))
    s.extend(prompt(T))
    full = s.state
    s.compress(policy)
    return against_oracle(s, full, f"{arch} {dtype}", steps)


def against_oracle(s: Session, full, what: str, steps: int = 2) -> Session:
    """``s`` (a compression of ``full``) continued by a chunk and ``steps`` decode steps, bitwise as the oracle."""
    compressed = s.state
    assert compressed.is_compressed
    oracle = Oracle(s, full, compressed)  # first and alone: some families hold recurrent state in modules
    try:
        feeds, want = [prompt(5, seed=4)], []
        for _ in range(steps + 1):
            want.append(oracle.step(feeds[-1]))
            feeds.append(want[-1].argmax(-1, keepdim=True))
    finally:
        oracle.context.__exit__(None, None, None)
    for step, (ids, expected) in enumerate(zip(feeds[:-1], want, strict=True)):
        got = s.extend(ids)
        assert torch.equal(got, expected), f"{what} step {step}: max |Δ| {(got - expected).abs().max():.3e}"
    return s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_every_policy_continues_as_its_per_head_mask(arch, name, dtype):
    s = check(arch, dtype, POLICIES[name]())
    if name in ("kvzip", "expected", "keep"):  # the faithful defaults choose per head
        assert any(getattr(layer, "per_head", False) for layer in s.state.layers), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_continues_as_its_per_head_mask(arch, dtype):
    check(arch, dtype, KVzip(0.5))


VIDEO_CHILD = r"""
import sys, torch
from safetensors.torch import save_file
from kvstate import Session
from kvstate.testing.tiny import tiny_model, tiny_prompt
s = Session.load(sys.argv[1], tiny_model(sys.argv[3]))  # a fresh instance in a new process; no pixels needed
out = [s.extend(tiny_prompt(5, seed=4))]
for _ in range(3):
    out.append(s.extend(out[-1].argmax(-1, keepdim=True)))
save_file({"logits": torch.cat(out).contiguous()}, sys.argv[2])
"""


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])  # Qwen3-VL: a run per frame; 2.5: seconds per grid
def test_compressed_video_state_resumes_exactly_here_and_in_another_process(arch, tmp_path):
    """The seed's own case: a video prefix compressed per head (the video kept whole), continued exactly, and
    its file continued bitwise by another process."""
    from safetensors.torch import load_file

    import children
    from kvstate.compress import MediaSpans
    from kvstate.testing.tiny import tiny_video, video_span
    from test_media_video import video_inputs

    pixels, grid = tiny_video()
    ids = torch.cat([prompt(6), video_span(arch, grid), prompt(14, seed=2)], 1)
    s = Session(model_in(arch, "float32"))
    s.extend(ids, **video_inputs(arch, (pixels, grid)))
    full = s.state
    (item,) = full.media
    s.compress(MediaSpans(policy=KVzip(0.5)))
    assert all(layer.per_head for layer in s.state.layers) and s.state.media[0].kept
    for layer in s.state.layers:  # the video whole in every head, the text halved around it
        for h in range(layer.keys.shape[1]):
            assert set(range(item.start, item.end)) <= set(kept_tokens(s.state, layer, h))
    s.save(tmp_path / "video.kvs")
    here = s.fork()
    against_oracle(s, full, arch)
    out = [here.extend(prompt(5, seed=4))]
    for _ in range(3):
        out.append(here.extend(out[-1].argmax(-1, keepdim=True)))
    children.run(VIDEO_CHILD, str(tmp_path / "video.kvs"), str(tmp_path / "out.safetensors"), arch)
    assert torch.equal(load_file(str(tmp_path / "out.safetensors"))["logits"], torch.cat(out))
