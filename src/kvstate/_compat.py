"""Every contact with transformers internals lives here (tested with 5.24).

What moves between transformers minor releases: the cache keyword (5.24 renamed
``past_key_values`` to ``cache``), cache layer classes and their private fields
(``cumulative_length``), and the private generation helpers used to pick the first
token from stored logits. Nothing else in kvstate imports ``transformers`` internals.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .errors import UnsupportedError
from .layers import AttentionLayerState, LayerState

CACHE_KWARG = "cache"  # was "past_key_values" before 5.24


def output_cache(outputs: object) -> DynamicCache:
    """The cache a forward returned (``outputs.cache`` since 5.24)."""
    return outputs.cache  # type: ignore[attr-defined]


def layer_specs(config: object) -> list[tuple[str, int | None]]:
    """``(kind, window)`` per decoder layer, decided exactly as transformers decides it."""
    specs: list[tuple[str, int | None]] = []
    for i, layer in enumerate(DynamicCache(config=config).layers):  # type: ignore[arg-type]
        if isinstance(layer, DynamicSlidingWindowLayer):
            specs.append(("sliding_attention", int(layer.sliding_window)))
        elif type(layer) is DynamicLayer:
            specs.append(("full_attention", None))
        else:
            raise UnsupportedError(
                f"layer {i} uses transformers cache layer {type(layer).__name__}",
                expected="full or sliding-window attention layers",
                found=type(layer).__name__, fix="use a model family kvstate supports "
                "(`kvstate verify --list`)")
    return specs


def build_cache(layers: tuple[LayerState, ...], config: object) -> DynamicCache:
    """A transformers ``DynamicCache`` whose layers hold the state's tensors (no copies).

    Sliding layers record their past so that they return every slot they were
    given; ``read_cache`` trims them back to the window plus reserve.
    """
    cache = DynamicCache(config=config)  # type: ignore[arg-type]
    for hf_layer, layer in zip(cache.layers, layers, strict=True):
        if not isinstance(layer, AttentionLayerState):
            raise UnsupportedError("cannot convert layer to a transformers cache layer",
                                   found=type(layer).__name__)
        if isinstance(hf_layer, DynamicSlidingWindowLayer):
            hf_layer.activate_past_recording()
            hf_layer.cumulative_length = layer.tokens_seen
        if layer.keys is not None:
            hf_layer.lazy_initialization(layer.keys, layer.values)
            hf_layer.keys, hf_layer.values = layer.keys, layer.values
    return cache


def read_cache(cache: DynamicCache, layers: tuple[LayerState, ...],
               new_positions: torch.Tensor) -> tuple[LayerState, ...]:
    """New layer states after transformers appended the tokens at ``new_positions`` ``[B, Q]``."""
    out: list[LayerState] = []
    for hf_layer, layer in zip(cache.layers, layers, strict=True):
        assert isinstance(layer, AttentionLayerState)
        seen = cache_tokens_seen(hf_layer)
        keys, values = hf_layer.keys, hf_layer.values
        added = seen - layer.tokens_seen
        old = layer.positions if layer.positions is not None else new_positions[:, :0]
        # Fed tokens are appended in order; a rolled-back extra step drops the last ones.
        positions = torch.cat([old, new_positions[:, :added]], dim=1)
        positions = positions[:, positions.shape[1] - keys.shape[-2]:]
        out.append(layer.appended(keys, values, positions, seen))
    return tuple(out)


def cache_tokens_seen(hf_layer: object) -> int:
    """Tokens seen by one transformers cache layer (its own notion, per class)."""
    if isinstance(hf_layer, DynamicSlidingWindowLayer):
        return int(hf_layer.cumulative_length)
    return int(hf_layer.get_seq_length())  # type: ignore[attr-defined]


def generation_config(model: object, kwargs: dict[str, object]) -> tuple[GenerationConfig, dict]:
    """The model's generation config updated with ``kwargs``; returns (config, model kwargs)."""
    config = copy.deepcopy(model.generation_config)  # type: ignore[attr-defined]
    unused = config.update(**kwargs)
    return config, unused


def first_token(model: object, config: GenerationConfig, input_ids: torch.Tensor,
                logits: torch.Tensor) -> torch.Tensor:
    """Pick the next token ``[B]`` from stored ``logits`` ``[B, V]`` the way ``generate`` would."""
    config = copy.deepcopy(config)  # the helper below turns special tokens into tensors in place
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True,  # type: ignore[attr-defined]
                                  device=input_ids.device, batch_size=input_ids.shape[0])
    processors = model._get_logits_processor(  # type: ignore[attr-defined]
        generation_config=config, input_ids_seq_length=input_ids.shape[-1],
        encoder_input_ids=input_ids, prefix_allowed_tokens_fn=None, logits_processor=None,
        device=input_ids.device, model_kwargs={})
    scores = processors(input_ids, logits.to(dtype=torch.float32, copy=True))
    if config.do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return torch.argmax(scores, dim=-1)


@contextmanager
def capture_logits(model: torch.nn.Module) -> Iterator[Callable[[int], torch.Tensor | None]]:
    """Record each forward's last-position logits keyed by the cache length after it.

    Yields ``lookup(tokens_seen) -> logits [B, V] | None``. Keyed, not "latest", because
    generate may run one extra step and roll it back (``DeferredStopCheck``).
    """
    seen: dict[int, torch.Tensor] = {}

    def hook(_module: object, _args: object, _kwargs: object, output: object) -> None:
        cache = output_cache(output)
        if cache is None or not cache.layers:
            return
        n = cache_tokens_seen(cache.layers[0])
        if len(seen) > 4:
            seen.pop(min(seen))
        seen[n] = output.logits[:, -1, :].detach()  # type: ignore[attr-defined]

    handle = model.register_forward_hook(hook, with_kwargs=True)
    try:
        yield seen.get
    finally:
        handle.remove()
