"""Cache and model-side helpers over transformers internals (5.14 through 5.25; ``generation`` holds
the seams of ``generate``).

What moves between transformers minor releases, and how this module follows it:
the cache keyword (5.24 renamed ``past_key_values`` to ``cache``: read from the output
class's fields), cache layer classes (``DummyLayer`` exists from 5.2x: optional) and
their private fields (``cumulative_length``), and the generation helpers
``_prepare_generation_config`` and ``_prefill``. Nothing else in kvstate imports
``transformers`` internals; ``versions`` holds the window.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache, cache_utils
from transformers.cache_utils import (
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..errors import KVStateError, UnsupportedError
from ..layers import (
    AttentionLayerState,
    HybridLayerState,
    IndexedLayerState,
    LayerState,
    RecurrentLayerState,
    StatelessLayerState,
)

# the field outputs carry the cache in: "cache" from 5.24, "past_key_values" before (feature-detected)
CACHE_KWARG = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# the forward keywords a cache may travel in, newest first (5.14's Mamba-style models take cache_params)
_CACHE_NAMES = ("cache", "past_key_values", "cache_params")


def cache_kwarg(model: Any) -> str | None:
    """The keyword ``model.forward`` takes its transformers cache in; None if it takes none."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in _CACHE_NAMES if name in params), None)
# mllama's empty cross-attention layers on the text path; older versions leave a plain DynamicLayer
DummyLayer = getattr(cache_utils, "DummyLayer", None)


_SPECS: dict[int, tuple[weakref.ref[Any], str, tuple[tuple[str, int | None], ...]]] = {}


def layer_specs(config: object) -> list[tuple[str, int | None]]:
    """``(kind, window)`` per decoder layer, decided exactly as transformers decides it.

    Remembered per config object while its attributes are unchanged: every session and load asks, and
    building the probe cache costs more than the lookup."""
    try:
        key = repr(sorted(vars(config).items(), key=lambda item: item[0]))
    except TypeError:  # no __dict__: nothing to remember it by
        return _declared_specs(config)
    hit = _SPECS.get(id(config))
    if hit is not None and hit[0]() is config and hit[1] == key:
        return list(hit[2])
    specs = _declared_specs(config)
    if len(_SPECS) > 256:  # configs of models long gone
        _SPECS.clear()
    _SPECS[id(config)] = (weakref.ref(config), key, tuple(specs))
    return specs


def _declared_specs(config: object) -> list[tuple[str, int | None]]:
    specs: list[tuple[str, int | None]] = []
    for i, layer in enumerate(DynamicCache(config=config).layers):  # type: ignore[arg-type]
        kind = _KIND_OF.get(type(layer))
        if kind is None:
            raise UnsupportedError(
                f"layer {i} uses transformers cache layer {type(layer).__name__}",
                expected=" / ".join(c.__name__ for c in _KIND_OF), found=type(layer).__name__,
                fix="use a model family kvstate supports (`kvstate verify --list`)")
        specs.append((kind, _window(layer)))
    return specs


def observe_layout(model: Any, ids: torch.Tensor) -> list[tuple[str, int | None]]:
    """``(kind, window)`` per cache layer as one forward of ``ids`` ``[1, Q]`` actually used them.

    Differs from ``layer_specs`` for two kinds of models: looped ones append a cache layer per
    extra pass of their shared layers (dory, inkling2_loop), and some leave a layer empty on the
    text-only path (mllama's cross-attention layers), which holds no state there ("stateless").
    """
    config = model.config.get_text_config(decoder=True)
    declared = layer_specs(config)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model) or CACHE_KWARG: cache})
    specs: list[tuple[str, int | None]] = []
    for i, hf_layer in enumerate(cache.layers):
        kind, window = declared[i] if i < len(declared) else _appended(hf_layer)
        if kind in ("full_attention", "sliding_attention") and not _holds_keys(hf_layer):
            kind, window = "stateless", None
        specs.append((kind, window))
    return specs


def _appended(hf_layer: Any) -> tuple[str, int | None]:
    """``(kind, window)`` of a cache layer the model appended beyond the config's."""
    kind = _KIND_OF.get(type(hf_layer))
    if kind is None:
        raise UnsupportedError(f"the model appended a cache layer of class {type(hf_layer).__name__}",
                               expected=" / ".join(c.__name__ for c in _KIND_OF), found=type(hf_layer).__name__,
                               fix="use a model family kvstate supports (`kvstate verify --list`)")
    return kind, _window(hf_layer)


def _window(hf_layer: Any) -> int | None:
    return int(hf_layer.sliding_window) if isinstance(hf_layer, DynamicSlidingWindowLayer) else None


def _holds_keys(hf_layer: Any) -> bool:
    keys = getattr(hf_layer, "keys", None)
    return bool(getattr(hf_layer, "is_initialized", False)) and keys is not None and keys.numel() > 0


def _extra_layers(declared: list[Any], layers: tuple[LayerState, ...]) -> list[Any]:
    """Cache layers for the state layers past the config's count (a looped model's extra passes):
    an empty copy of the first declared layer of the same kind and window, as the model makes them."""
    def spec(layer: LayerState) -> tuple[str, int | None]:
        window = layer.meta().get("window")  # a recurrent layer's meta has none
        return layer.kind, None if window is None else int(window)  # type: ignore[call-overload]

    out = []
    for layer in layers[len(declared):]:
        if layer.kind == "stateless":
            out.append(DynamicLayer())
            continue
        template = next((t for t in declared if (_KIND_OF.get(type(t)), _window(t)) == spec(layer)), None)
        if template is None:
            raise KVStateError("the state has a layer the model's config cannot make", expected="a declared kind",
                               found=spec(layer), fix="load this state into the model it was made with")
        out.append(copy.deepcopy(template))
    return out


_KIND_OF: dict[type, str] = {
    DynamicLayer: "full_attention",
    DynamicSlidingWindowLayer: "sliding_attention",
    DynamicIndexedLayer: "indexed_attention",
    LinearAttentionLayer: "recurrent",
    LinearAttentionAndFullAttentionLayer: "hybrid",
    LinearAttentionAndSlidingWindowAttentionLayer: "hybrid",  # with its window
}
if DummyLayer is not None:
    _KIND_OF[DummyLayer] = "stateless"


def build_cache(layers: tuple[LayerState, ...], config: object) -> DynamicCache:
    """A transformers ``DynamicCache`` holding the state's tensors.

    K/V are shared, not copied (transformers concatenates, never writes them in place).
    Conv and recurrent states are cloned, because models update those in place.
    Sliding layers record their past so that they return every slot they were given;
    ``read_cache`` trims them back to the window, reserve and last append. Each layer kind's bridge
    (``_BRIDGES``, one entry per ``LayerState`` class) fills and reads its cache layer.
    """
    cache = DynamicCache(config=config)  # type: ignore[arg-type]
    cache.layers += _extra_layers(cache.layers, layers)  # a looped model's extra passes
    cache.layers = [_recording(hf_layer) for hf_layer in cache.layers]
    for hf_layer, layer in zip(cache.layers, layers, strict=True):
        _BRIDGES[type(layer)].fill(hf_layer, layer)
    return cache


class _RecordingSlidingLayer(DynamicSlidingWindowLayer):
    """A sliding layer that keeps every slot it is given and returns only the ``window - 1 + Q``
    visible ones, which the mask is sized for. 5.24's ``activate_past_recording`` does the same;
    5.14's layer cannot record (it keeps ``window - 1`` slots, dropping kvstate's rollback
    reserve), and 5.15's recording returns every slot, more than its own mask covers. One class
    for every version keeps the behaviour the same across the window."""

    def __init__(self, sliding_window: int, **kwargs: Any) -> None:
        super().__init__(sliding_window, **kwargs)
        self.record_past = True  # what Cache.is_recording_past reports

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        self.keys, self.values = self.store(key_states, value_states)
        visible = self.sliding_window - 1 + key_states.shape[-2]
        return self.keys[:, :, -visible:, :], self.values[:, :, -visible:, :]

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot with ``keys``/``values`` appended (``room.reserve`` makes it write in place)."""
        return torch.cat([self.keys, keys], dim=-2), torch.cat([self.values, values], dim=-2)


_RECORDS_PAST = hasattr(DynamicSlidingWindowLayer, "activate_past_recording")


def _recording(hf_layer: Any) -> Any:
    """``hf_layer``, set to keep every slot it is given (a sliding layer records its past)."""
    if type(hf_layer) is DynamicSlidingWindowLayer:
        return _RecordingSlidingLayer(sliding_window=hf_layer.sliding_window)
    if isinstance(hf_layer, DynamicSlidingWindowLayer) and _RECORDS_PAST:  # hybrid sliding layers
        hf_layer.activate_past_recording()
    return hf_layer


def _fill_attention(hf_layer: Any, layer: AttentionLayerState) -> None:
    if isinstance(hf_layer, DynamicSlidingWindowLayer):
        hf_layer.cumulative_length = layer.tokens_seen
    if layer.keys is not None:
        DynamicLayer.lazy_initialization(hf_layer, layer.keys, layer.values)
        if isinstance(hf_layer, DynamicSlidingWindowLayer):
            hf_layer._sliding_window_tensor = hf_layer._sliding_window_tensor.to(layer.keys.device)
        hf_layer.keys, hf_layer.values = layer.keys, layer.values


def _fill_recurrent(hf_layer: Any, layer: RecurrentLayerState) -> None:
    for i, conv in layer.conv.items():
        hf_layer.conv_states[i] = conv.clone()
        hf_layer.conv_kernel_size[i] = conv.shape[-1]
        hf_layer.is_conv_states_initialized[i] = True
        hf_layer.has_previous_state[i] = True  # without it the next chunk is treated as a prefill
        hf_layer.device, hf_layer.dtype = conv.device, conv.dtype
    for i, rec in layer.recurrent.items():
        hf_layer.recurrent_states[i] = rec.clone()
        hf_layer.is_recurrent_states_initialized[i] = True
        hf_layer.has_previous_state[i] = True
        hf_layer.device = hf_layer.device or rec.device


def read_cache(cache: DynamicCache, layers: tuple[LayerState, ...], new_positions: torch.Tensor,
               tokens_seen: int) -> tuple[LayerState, ...]:
    """New layer states after transformers appended the tokens fed at ``new_positions`` ``[B, Q(, R)]``.

    ``Q`` and ``tokens_seen`` come from the engine's record of what was fed, never from
    the tensors: a layer that did not append exactly ``Q`` slots is an error.
    """
    if len(cache.layers) != len(layers):
        raise KVStateError("the model changed its cache's layer count during a forward",
                           expected=f"{len(layers)} layers, as the state holds", found=len(cache.layers),
                           fix="a dynamic-depth model: kvstate cannot hold its state exactly")
    return tuple(_BRIDGES[type(layer)].read(i, hf_layer, layer, new_positions, tokens_seen)
                 for i, (hf_layer, layer) in enumerate(zip(cache.layers, layers, strict=True)))


def _read_stateless(index: int, hf_layer: Any, layer: StatelessLayerState, new_positions: torch.Tensor,
                    tokens_seen: int) -> StatelessLayerState:
    if _holds_keys(hf_layer):  # a layer empty on the probe's path filled up: its state would be lost
        raise KVStateError(f"layer {index} stored keys, but held none when kvstate examined this model",
                           expected="an empty layer", found=tuple(hf_layer.keys.shape),
                           fix="this model fills layers depending on its inputs; report it with "
                           "`kvstate verify --model ...`")
    return StatelessLayerState(tokens_seen)


def _read_indexed(index: int, hf_layer: Any, layer: IndexedLayerState, new_positions: torch.Tensor,
                  tokens_seen: int = 0) -> IndexedLayerState:
    attention = _read_attention(index, hf_layer, layer.attention, new_positions)
    keys = hf_layer.indexer_keys if hf_layer.is_indexer_initialized else None  # None: a shared indexer
    positions = hf_layer.indexer_position_ids
    if (keys is not None and keys.shape[1] != attention.slots) or (
            positions is not None and positions.shape[-1] != attention.slots):
        raise KVStateError(f"layer {index}'s indexer state does not follow its slots",
                           expected=f"{attention.slots} indexer keys and positions",
                           found=[None if t is None else tuple(t.shape) for t in (keys, positions)],
                           fix="report this model with `kvstate verify --model ...`")
    return IndexedLayerState(attention, keys, positions)


def _read_attention(index: int, hf_layer: Any, layer: AttentionLayerState,
                    new_positions: torch.Tensor) -> AttentionLayerState:
    added = new_positions.shape[1]
    stored = 0 if hf_layer.keys is None or not hf_layer.is_initialized else int(hf_layer.keys.shape[-2])
    # Sliding layers may only be trimmed (to the window) by generate's own stop check; nothing else may differ.
    if stored != layer.slots + added and not (layer.window is not None and stored < layer.slots + added):
        raise KVStateError(f"layer {index} did not store the tokens it was fed", expected=layer.slots + added,
                           found=stored, fix="this model does not fill the transformers cache it is given; "
                           "report it with `kvstate verify --model ...`")
    positions = layer.joined(new_positions, stored)  # per-head layers: the same new positions for every head
    return layer.appended(hf_layer.keys, hf_layer.values, positions, layer.tokens_seen + added)


def _read_recurrent(hf_layer: Any, tokens_seen: int) -> RecurrentLayerState:
    # a layer the model keeps its state outside of (RecurrentGemma on 5.14: a sliding layer) holds none
    conv = {i: t for i, t in getattr(hf_layer, "conv_states", {}).items() if t is not None}
    rec = {i: t for i, t in getattr(hf_layer, "recurrent_states", {}).items() if t is not None}
    return RecurrentLayerState(conv, rec, tokens_seen)


def _fill_indexed(hf_layer: Any, layer: IndexedLayerState) -> None:
    _fill_attention(hf_layer, layer.attention)
    if layer.indexer_keys is not None:
        hf_layer.lazy_initialization_indexer(layer.indexer_keys)
        hf_layer.indexer_keys = layer.indexer_keys
    hf_layer.indexer_position_ids = layer.indexer_positions


def _fill_hybrid(hf_layer: Any, layer: HybridLayerState) -> None:
    _fill_attention(hf_layer, layer.attention)
    _fill_recurrent(hf_layer, layer.recurrent)


def _read_hybrid(index: int, hf_layer: Any, layer: HybridLayerState, new_positions: torch.Tensor,
                 tokens_seen: int) -> HybridLayerState:
    return HybridLayerState(_read_attention(index, hf_layer, layer.attention, new_positions),
                            _read_recurrent(hf_layer, tokens_seen))


@dataclasses.dataclass(frozen=True)
class _Bridge:
    """How one ``LayerState`` class moves in (``fill``) and out (``read``) of a transformers cache layer."""

    fill: Callable[[Any, Any], None]
    read: Callable[[int, Any, Any, torch.Tensor, int], LayerState]


# one entry per layer-state class: a new kind is a new entry, never another branch in a chain
_BRIDGES: dict[type, _Bridge] = {
    AttentionLayerState: _Bridge(_fill_attention, lambda i, hf, layer, positions, _seen: _read_attention(
        i, hf, layer, positions)),
    RecurrentLayerState: _Bridge(_fill_recurrent, lambda _i, hf, _layer, _positions, seen: _read_recurrent(hf, seen)),
    HybridLayerState: _Bridge(_fill_hybrid, _read_hybrid),
    IndexedLayerState: _Bridge(_fill_indexed, _read_indexed),
    StatelessLayerState: _Bridge(lambda _hf, _layer: None, _read_stateless),
}


def recurrent_state(cache: Any, layer_idx: int) -> torch.Tensor | None:
    """A linear-attention layer's cached recurrent state (index 0), or None before its first forward.
    ``Cache.get_recurrent_state`` exists from 5.21; 5.15 - 5.20 keep the same on the layer."""
    getter = getattr(cache, "get_recurrent_state", None)
    if getter is not None:
        return getter(layer_idx, state_idx=0)
    layer = cache.layers[layer_idx]
    return layer.recurrent_states[0] if layer.has_previous_state[0] else None


def set_rope_deltas(model: Any, value: torch.Tensor | None) -> None:
    """Qwen-VL keeps its M-RoPE offset on the inner model (``model.model.rope_deltas``)."""
    model.model.rope_deltas = value


def rope_index(model: Any, ids: torch.Tensor, token_types: torch.Tensor, mask: torch.Tensor,
               image_grid: torch.Tensor | None, video_grid: torch.Tensor | None,
               second_per_grid_ts: torch.Tensor | None = None) -> torch.Tensor:
    """Qwen-VL M-RoPE positions ``[3, B, Q]`` of a chunk that starts at position 0; ``token_types``
    ``[B, Q]`` is transformers' ``mm_token_type_ids`` (0 text, 1 image, 2 video)."""
    extra = {} if second_per_grid_ts is None else {"second_per_grid_ts": second_per_grid_ts}
    positions, _ = model.model.get_rope_index(ids, token_types.int(), image_grid_thw=image_grid,
                                              video_grid_thw=None if video_grid is None else video_grid.clone(),
                                              attention_mask=mask.long(), **extra)
    return positions


def recurrent_gemma_blocks(model: Any) -> list[Any]:
    """RecurrentGemma's recurrent blocks (``temporal_block`` of recurrent layers), by layer index."""
    kinds = model.config.block_types  # "recurrent" or "attention", repeated over the layers
    return [layer.temporal_block if kinds[i % len(kinds)] == "recurrent" else None
            for i, layer in enumerate(model.model.layers)]


def recurrent_gemma_specs(config: Any) -> list[tuple[str, int | None]]:
    """``(kind, window)`` per RecurrentGemma layer from its ``block_types``: 5.24's config declares the
    same as ``layer_types``, 5.14's declares none (its cache then makes every layer sliding)."""
    kinds = config.block_types
    return [("recurrent", None) if kinds[i % len(kinds)] == "recurrent" else
            ("sliding_attention", int(config.attention_window_size)) for i in range(config.num_hidden_layers)]


def recurrent_gemma_zero(model: Any, batch_size: int, device: torch.device, dtype: torch.dtype) -> None:
    """Zero RecurrentGemma's module-held conv and RG-LRU states (its ``_setup_cache``)."""
    model.model._setup_cache(model.config, batch_size, device, dtype)


def attention_implementation(model: Any) -> str:
    """The attention backend the decoder runs with (e.g. ``sdpa`` or ``eager``)."""
    return str(model.config.get_text_config(decoder=True)._attn_implementation)


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers, in order (for Qwen-VL, those of the language model)."""
    return list(model.get_decoder().layers)


def has_decoder_layers(model: Any) -> bool:
    """Whether the decoder keeps its layers as ``layers`` (GPT-2's ``h`` and Falcon's do not), where kvstate hooks
    per-layer masks and watches attention."""
    return isinstance(getattr(model.get_decoder(), "layers", None), torch.nn.ModuleList)


# id(text config) -> [(config, the backend before, whether the swap was kvstate's own engine detail), ...]
_SWAPS: dict[int, list[tuple[Any, str, bool]]] = {}


@contextmanager
def attention_backend(model: Any, name: str, *, internal: bool = False) -> Iterator[None]:
    """Temporarily run ``model`` with another attention implementation (e.g. eager for weights).

    ``internal``: the swap is how kvstate runs the configured backend (its deterministic kernels, the
    compression watch, the packed decode), not another backend: ``configured_implementation`` sees through it."""
    configs = list({id(c): c for c in (model.config, model.config.get_text_config(decoder=True))}.values())
    before = [c._attn_implementation for c in configs]
    text = configs[-1]
    _SWAPS.setdefault(id(text), []).append((text, str(before[-1]), internal))
    try:
        for c in configs:
            c._attn_implementation = name
        yield
    finally:
        for c, value in zip(configs, before, strict=True):
            c._attn_implementation = value
        swaps = _SWAPS[id(text)]
        swaps.pop()
        if not swaps:
            del _SWAPS[id(text)]


def configured_implementation(model: Any) -> str:
    """The attention backend ``model`` was configured with: ``attention_implementation`` with kvstate's own
    internal swaps (``attention_backend(internal=True)``) peeled off. A state's kernels label is read from it, so
    a state made inside the deterministic path is labelled as the sdpa model that made it."""
    text = model.config.get_text_config(decoder=True)
    name = attention_implementation(model)
    for config, before, internal in reversed(_SWAPS.get(id(text), [])):
        if config is not text or not internal:
            break
        name = before
    return name


def attention_function(module: Any, name: str) -> Callable[..., Any]:
    """The attention function ``module`` runs under backend ``name``: the registered one, or for ``eager`` the
    eager attention of the module's own modeling file (softcaps, sinks and all), else Llama's."""
    if name != "eager":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[name]
    found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if found is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as found
    return found  # type: ignore[no-any-return]


def register_attention(name: str, function: Callable[..., Any]) -> None:
    """Register ``function`` in transformers' ``AttentionInterface`` as backend ``name`` (no mask function:
    transformers builds no mask for it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)


def rope_inv_freq(model: Any) -> torch.Tensor:
    """Inverse frequencies ``[D / 2]`` of a model with one static RoPE (default, linear, llama3)."""
    config = model.config.get_text_config(decoder=True)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", "linear", "llama3"):
        raise UnsupportedError("key re-rotation needs a static RoPE", expected="default, linear or llama3",
                               found=rope.get("rope_type"), fix="use the policy without ReRotate")
    rotary = model.get_decoder().rotary_emb
    if not isinstance(getattr(rotary, "inv_freq", None), torch.Tensor):
        raise UnsupportedError("key re-rotation needs one rotary embedding per model",
                               found=type(rotary).__name__, fix="use the policy without ReRotate")
    return rotary.inv_freq


def empty_cache(config: object) -> DynamicCache:
    """An empty transformers cache for ``config`` (a placeholder that ``generate`` never reads)."""
    return DynamicCache(config=config)  # type: ignore[arg-type]


def unbounded_cache(model: Any) -> DynamicCache | None:
    """The transformers cache ``generate`` makes for ``model``, but whose sliding-window attention layers keep
    every token: a reference that masks by hand then sees every column it masks. None unless every layer of
    that cache is a plain attention layer (recurrent and hybrid layers keep state this cannot replace)."""
    own = getattr(model, "_supports_default_dynamic_cache", None)  # generate's own test (private)
    if cache_kwarg(model) is None or (own is not None and not own()):
        return None
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))  # type: ignore[arg-type]
    if not all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers):
        return None
    cache.layers = [DynamicLayer() for _ in cache.layers]
    return cache
