"""The attention path of kvstate's forwards: deterministic kernels on CUDA, and a planted fault.

A warm answer equals the cold one bit for bit only if the same computation in the same shape gives
the same bits, run after run. CPU kernels do. On CUDA, transformers' ``sdpa`` lets PyTorch pick a
kernel per call, and for a masked forward on Hopper it picks cuDNN attention, whose results differ
between two identical runs (measured on an H200 at 1k tokens: max |Δlogit| 0.03-0.16 over 8 steps).
So on CUDA every forward kvstate runs on an ``sdpa`` model goes through ``kvstate_deterministic``
(registered in ``AttentionInterface`` on first use, never at import; the model runs it only inside
``deterministic``), which calls one named kernel per case, chosen by ``choose`` from the call's shape
and mask alone:

* a mask that lets every query see every key, or exactly the causal pattern aligned to the last key
  (a canonical chunk after its cache: ``causal_lower_right``), runs **flash** attention, whose forward is
  deterministic, with no dense mask (PyTorch's flash kernel refuses one);
* any other mask (padding, a sliding window that cuts, compressed slots, bidirectional media) runs the
  **math** kernel with the dense mask: deterministic, and slower;
* calls with a positional bias, a soft cap, sinks or dropout run transformers' own ``sdpa`` function
  restricted to the math kernel.

``choose`` is the one rule for every attention call kvstate decides, on any device: these CUDA kernels, and
the decode rows of a packed forward (``kvstate.engine.batched``), which run the grouped form or one pooled
call per pool where that computes what the row's own call would; every other call runs the backend's own
function (``own``: CPU kernels repeat their bits). Which kernel a forward took is a function of its shape,
so a cold run and a warm one take the same.
The path is part of a state's canonical identity (``kernels``: ``State.canonical_device`` records it), read
from the backend the model was configured with (``configured_implementation``), never from the name swapped in
while it runs. On CUDA that identity also names the GPU (``identity``): flash's split of the keys depends on
the number of multiprocessors and cuBLAS's algorithms on the GPU, so bits made on one GPU model or MIG slice
are not another's. Calls that are not causal (a vision tower's bidirectional attention: ``is_causal=False``
on the call or the module) are classified as such, never as the causal pattern of a text chunk.
``known_deterministic`` says which paths kvstate trusts to repeat: CPU kernels, and on CUDA ``sdpa``
(through this module) and ``eager``; other backends (flash-attn 2/3, flex, custom kernels) have not been
measured, so a ``Session`` does not promise bitwise resumes on them.

``noisy`` plants run-dependent noise in every attention output (``kvstate verify --inject
nondeterministic-attention``, on any device): what nondeterministic kernels do, so the report's
diagnosis of it can be tested on a CPU.
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .core import attention_backend, attention_function, attention_implementation, configured_implementation

NAME = "kvstate_deterministic"
NOISY = "kvstate_noisy"  # NOISY + ":" + the implementation it wraps
WATCH = "kvstate_watch"  # the compression watch's backend (``kvstate._compat.watch``), whose masks are eager's
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
NOISE = 1e-3  # relative to the largest attention output of the call: small, like a kernel's rounding
_LOCAL = threading.local()  # this thread's mask classifications and kernel counts (``deterministic``)


MATH_DEVICES = {"cuda"}  # device types where kvstate names each kernel: PyTorch's pick for a masked call can be cuDNN
REDUCED = (torch.bfloat16, torch.float16)  # where the grouped decode form is the faster CPU kernel


@dataclass(frozen=True)
class Path:
    """How one attention call runs: its ``kernel`` (``flash``, ``math``, ``sdpa-math``: transformers' function on
    the math kernel; ``sdpa``: PyTorch's SDPA, its own pick of kernel; ``own``: the backend's function as
    transformers calls it), the form its mask takes (``none``: every key visible; ``lower_right``: causal,
    aligned to the last key; ``dense``: the mask tensor, additive; ``bool``: a boolean mask tensor), and the
    call's ``form``: ``call`` (the call as the model makes it), ``grouped`` (a packed decode row, the query heads
    of each K/V head as the rows of one query) or ``pooled`` (every decode row of a pool in one call;
    ``kvstate.engine.batched.packed`` and ``pool``)."""

    kernel: str
    mask: str
    form: str = "call"


def choose(device: str, dtype: torch.dtype, head_dim: int, mask: str, extras: bool = False, *,
           backend: str = NAME, groups: int = 1, decode: str | None = None,
           free: Callable[[Path], bool] | None = None) -> Path:
    """The path of one attention call: the one rule for every attention kvstate runs (module docstring).

    The call runs on ``device`` (a device type) in ``dtype`` with heads of ``head_dim`` (the wider of the query's
    and the value's); ``mask`` is ``none``, ``causal`` (exactly lower-right causal) or ``dense`` (anything else);
    ``extras``: a positional bias, soft cap, sinks, dropout or attention weights asked for; ``backend``: the
    attention implementation the model runs (``sdpa``, ``NAME`` on CUDA, ``eager``...); ``groups``: query heads
    per K/V head (0: not a whole number). ``decode`` marks a decode row of a packed forward whose tile is not
    ``Session``'s one row: ``pooled`` where its stream holds a pool slot, else ``row``. ``free(path)``: the pool's
    padding probe of a candidate pooled path, a measurement asked only where the rest allows one. Pure otherwise."""
    sdpa = backend in ("sdpa", NAME) and not extras and groups > 0
    if decode == "pooled" and sdpa and free is not None:
        pooled = Path("math", "dense", "pooled") if device in MATH_DEVICES else Path("sdpa", "bool", "pooled")
        if free(pooled):
            return pooled
    if decode is not None and sdpa and backend == "sdpa" and dtype in REDUCED and groups > 1:
        return Path("sdpa", "none", "grouped")
    if device not in MATH_DEVICES or backend != NAME:
        return Path("own", mask)
    if extras:
        return Path("sdpa-math", "dense" if mask == "dense" else mask)
    plain = mask in ("none", "causal")
    if plain and dtype in FLASH_DTYPES and head_dim <= FLASH_MAX_HEAD_DIM:
        return Path("flash", "none" if mask == "none" else "lower_right")
    return Path("math", "none" if mask == "none" else "dense")


def classify(q: int, kv: int, mask: torch.Tensor | None, causal: bool = True) -> str:
    """``none``, ``causal`` or ``dense`` for a call of ``q`` queries over ``kv`` keys whose mask is ``mask``
    (transformers' sdpa mask: boolean, True = visible, or additive with 0 = visible; ``[B, 1 | H, q, kv]``).
    None means what transformers' sdpa does without a mask: every key when the call is not ``causal`` (its
    ``is_causal``, else the module's: a vision tower's bidirectional attention) or has one query; causal when
    ``q == kv``; otherwise causal from the first key (``is_causal``'s upper-left alignment), ``dense`` here."""
    if mask is None:
        return "none" if q == 1 or not causal else "causal" if q == kv else "dense"
    cache = getattr(_LOCAL, "kinds", None)
    key = id(mask)
    if cache is not None and key in cache and cache[key][0] is mask:
        return cache[key][1]
    kind = _kind(q, kv, mask)
    if cache is not None:
        if len(cache) >= 8:  # the masks of one forward (one per layer type); decode steps make new ones
            cache.pop(next(iter(cache)))
        cache[key] = (mask, kind)
    return kind


def _kind(q: int, kv: int, mask: torch.Tensor) -> str:
    if mask.dtype == torch.bool:
        visible = mask
    else:  # additive: 0 visible, a huge negative hidden; any other value is a bias the dense kernel must add
        hidden = mask <= torch.finfo(mask.dtype).min / 2
        if not bool(((mask == 0) | hidden).all()):
            return "dense"
        visible = ~hidden
    if visible.shape[-2:] != (q, kv):
        return "dense"
    if bool(visible.all()):
        return "none"
    causal = torch.ones(q, kv, dtype=torch.bool, device=mask.device).tril(kv - q)
    return "causal" if bool((visible == causal).all()) else "dense"


def mask_format(name: str) -> str:
    """The backend whose masks ``name`` takes: sdpa's for the deterministic path, the wrapped backend's for the
    planted noise, eager's for the compression watch (``kvstate._compat.watch``)."""
    if name.startswith(NOISY):
        return mask_format(name.partition(":")[2])
    return "sdpa" if name == NAME else "eager" if name == WATCH else name


def known_deterministic(model: Any) -> bool:
    """Whether kvstate trusts ``model``'s attention path to give the same bits run after run (module docstring)."""
    return trusted(_device(model), configured_implementation(model))


def trusted(device: str, name: str) -> bool:
    """The rule of ``known_deterministic`` for a device type and an attention backend's name. The planted
    fault is trusted as the path it wraps: it stands for kernels believed deterministic that are not."""
    if name.startswith(NOISY):
        return trusted(device, name.partition(":")[2])
    return device == "cpu" or name == "eager" or (device == "cuda" and name == "sdpa")


def label(model: Any) -> str:
    """The attention part of a state's kernels label: empty for ``sdpa`` on the CPU (what every state of
    kvstate 0.2 on a CPU ran), ``det`` for ``sdpa`` through this module on CUDA, else the configured backend's
    name (inside ``deterministic`` or a compression watch too: ``configured_implementation``)."""
    device, name = _device(model), configured_implementation(model)
    if name == "sdpa":
        return "" if device != "cuda" else "det"
    return name


def kernels(model: Any) -> str:
    """A state's kernels label without the prefill tile: the device (on CUDA with the GPU's ``identity``) and
    the attention path (``label``), e.g. ``cpu``, ``cpu@eager``, ``cuda[NVIDIA H100 80GB HBM3|132sm|...]@det``."""
    device = _device(model)
    path = label(model)
    where = f"cuda[{identity(model)}]" if device == "cuda" else device
    return where + (f"@{path}" if path else "")


def identity(model: Any) -> str:
    """The CUDA device ``model`` runs on, as far as its kernels' bits go: the GPU's name, its multiprocessors (a
    MIG slice has fewer), CUDA's version and torch's (each picks kernels and splits)."""
    index = next(model.parameters()).device.index
    return _cuda_identity(torch.cuda.current_device() if index is None else index)


@functools.cache
def _cuda_identity(index: int) -> str:
    props = torch.cuda.get_device_properties(index)
    return f"{props.name}|{props.multi_processor_count}sm|cuda{torch.version.cuda}|torch{torch.__version__}"


def describe(model: Any) -> str:
    """What attention ``model``'s forwards under kvstate run, in words (``kvstate verify``'s report)."""
    device, name = _device(model), configured_implementation(model)
    if name.startswith(NOISY):
        return f"{name.partition(':')[2]} with run-dependent noise planted (--inject nondeterministic-attention)"
    if device == "cuda" and name == "sdpa":
        return (f"sdpa through kvstate's deterministic kernels (flash for causal chunks, math for other masks) on "
                f"{identity(model)}")
    return f"{name} ({device} kernels)"


@contextlib.contextmanager
def deterministic(model: Any) -> Iterator[None]:
    """Run ``model``'s forwards inside with the deterministic path where it applies (``sdpa`` on CUDA);
    elsewhere nothing changes. Entered under the model's lock; nests."""
    if _device(model) != "cuda" or attention_implementation(model) != "sdpa":
        yield
        return
    _register()
    outer = getattr(_LOCAL, "kinds", None)
    _LOCAL.kinds = {} if outer is None else outer
    try:
        with attention_backend(model, NAME, internal=True):
            yield
    finally:
        _LOCAL.kinds = outer


def counts() -> dict[str, int]:
    """Calls per kernel made by this thread's deterministic path since the last ``reset_counts``."""
    return dict(getattr(_LOCAL, "counts", {}))


def reset_counts() -> None:
    _LOCAL.counts = {}


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, deterministic_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # sdpa's masks, None where it skips


def deterministic_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` ``[B, H, q, D]``, ``key`` / ``value``
    ``[B, Hkv, kv, D]`` -> ``[B, q, H, Dv]``; one named kernel (``choose``), never PyTorch's pick."""
    extras = bool(dropout) or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks"))
    q, kv = query.shape[2], key.shape[2]
    causal = kwargs.get("is_causal")  # as transformers' sdpa function reads it: the call's, else the module's
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    path = choose(query.device.type, query.dtype, max(query.shape[3], value.shape[3]),
                  classify(q, kv, attention_mask, causal), extras)
    _LOCAL.counts = getattr(_LOCAL, "counts", {})
    _LOCAL.counts[path.kernel] = _LOCAL.counts.get(path.kernel, 0) + 1
    return attend(path, module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def attend(path: Path, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Run one call on ``path`` (shapes as ``deterministic_attention``); the math kernels run on any device."""
    if path.kernel == "sdpa-math":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        with sdpa_kernel(SDPBackend.MATH):
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
    q, kv, groups = query.shape[2], key.shape[2], query.shape[1] // key.shape[1]
    scale = query.shape[3] ** -0.5 if scaling is None else scaling
    if path.kernel == "flash":
        out = flash(query, key, value, scale, causal=path.mask == "lower_right")
    else:
        if groups > 1:  # one K/V head per query head, as transformers' sdpa function does with a mask
            key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        dense = None if path.mask == "none" else _dense(q, kv, attention_mask, query)
        out = torch.ops.aten._scaled_dot_product_attention_math(query, key, value, dense, scale=scale)[0]
    return out.transpose(1, 2).contiguous(), None


_NATIVE_GQA: list[bool] = []  # whether this torch's flash op takes fewer K/V heads than query heads (asked once)


def flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """PyTorch's flash kernel (CUDA, fp16 / bf16), causal aligned to the last key when ``causal`` (what its
    ``is_causal`` means for this op); head dims padded to a multiple of 8 as PyTorch pads them. ``[B, H, q, D]``.
    Grouped K/V heads go in as they are where the op takes them (FlashAttention-2 maps query head ``h`` to K/V
    head ``h // G``, as a repeat would): a decode over a long cache then copies nothing."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and not _NATIVE_GQA:
        try:
            _flash(query[:, :1, :1], key[:, :1, :1], value[:, :1, :1], scale, False)  # the op's shape check only
            _flash(query[:, :groups, :1], key[:, :1, :1], value[:, :1, :1], scale, False)
            _NATIVE_GQA.append(True)
        except RuntimeError:
            _NATIVE_GQA.append(False)
    if groups > 1 and not _NATIVE_GQA[0]:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    return _flash(query, key, value, scale, causal)


def _flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    D = value.shape[-1]
    pad = (-max(query.shape[-1], D)) % 8
    if pad or query.shape[-1] != D:
        width = max(query.shape[-1], D) + pad
        query, key, value = (torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False, scale=scale)[0]
    return out[..., :D]


def _dense(q: int, kv: int, mask: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """The additive mask the math kernel takes (``aten``'s math op adds a boolean mask as 0 / 1, unlike
    ``F.scaled_dot_product_attention``, which converts it first): the given one, or transformers' sdpa
    meaning of none (``classify``). A row that sees nothing gives zeros, as PyTorch's safe softmax does."""
    visible = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril() if mask is None else mask
    if visible.dtype != torch.bool:
        return visible
    return torch.zeros(visible.shape, dtype=query.dtype, device=query.device).masked_fill_(~visible, float("-inf"))


# ----- the planted fault: run-dependent noise ------------------------------------------------------------------
@contextlib.contextmanager
def noisy(model: Any) -> Iterator[None]:
    """Every attention output of ``model`` inside gets noise that differs from run to run (a fresh random seed
    per call, never the global generator, so sampling is untouched). For ``kvstate verify --inject
    nondeterministic-attention``."""
    inner = attention_implementation(model)
    name = f"{NOISY}:{inner}"
    _register_noisy(name, inner)
    with attention_backend(model, name):
        yield


@functools.cache
def _register_noisy(name: str, inner: str) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    def attention(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        out, weights = _function(module, inner, query.device.type)(module, query, *args, **kwargs)
        seed = random.SystemRandom().getrandbits(62)
        generator = torch.Generator(device=out.device).manual_seed(seed)
        noise = torch.rand(out.shape, generator=generator, device=out.device, dtype=torch.float32) - 0.5
        scale = out.detach().abs().amax().float() * NOISE
        return (out.float() + noise * scale).to(out.dtype), weights

    AttentionInterface.register(name, attention)
    masks = ALL_MASK_ATTENTION_FUNCTIONS
    AttentionMaskInterface.register(name, masks[inner] if inner in masks._global_mapping else masks["eager"])


def _function(module: Any, name: str, device: str) -> Callable[..., Any]:
    """The attention function ``module`` runs under backend ``name`` on ``device`` under kvstate."""
    if name == "sdpa" and device == "cuda":
        return deterministic_attention
    return attention_function(module, name)


def _device(model: Any) -> str:
    return next(model.parameters()).device.type
