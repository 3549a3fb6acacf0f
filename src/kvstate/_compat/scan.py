"""Multi-token continuation for Mamba-style selective scans (the coverage sweep).

Transformers 5.24's ``mamba_selective_scan`` (Mamba, Jamba, FalconMamba) has no initial-state
argument: its torch path starts every multi-token chunk from zeros ("Initial hidden state is
not supported by the kernel path"), while the layer's cached state sits unused in the cache.
The conv window is already continued correctly by ``cache.update_conv_state``. So within
``scans_from_cache(model)``, each mixer's forward records its layer's cached recurrent state,
and the scan that mixer calls next starts from it. The scan is the same sequential recurrence
``h_t = exp(A dt_t) h_{t-1} + dt_t B_t x_t`` the torch path runs, so a chunk continued this way
equals the whole forward to the last bits of the per-token projections.

The module-level function is swapped only while some run needs it (reference counted under a
lock, so concurrent runs on other models never see a half-restored name), and the swapped
function falls back to the original whenever the current thread recorded no state.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from .core import recurrent_state

_NAME = "mamba_selective_scan"
_LOCK = threading.Lock()
_INSTALLED: dict[ModuleType, tuple[int, Callable[..., Any]]] = {}  # module -> (users, original function)
_PENDING = threading.local()  # the cached state the next scan on this thread starts from
_MIXERS: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = weakref.WeakKeyDictionary()


def available(modeling: str) -> bool:
    """Whether transformers' ``modeling`` module (e.g. ``transformers.models.mamba.modeling_mamba``)
    has the scan function kvstate continues. 5.14's Mamba and Jamba have none: their multi-token
    forwards from a cache assume one token, so their adapters continue one token per forward."""
    import importlib

    return callable(getattr(importlib.import_module(modeling), _NAME, None))


def mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose forward calls their transformers module's ``mamba_selective_scan`` (found once
    per model: a walk over every module is not for each forward)."""
    found = _MIXERS.get(model)
    if found is None:
        found = []
        for module in model.modules():
            # transformers' own structure, read here only: a mixer is the module of a modeling file
            # that defines the scan, with the SSM's A_log parameter and its cache layer index
            home = sys.modules.get(type(module).__module__)
            if home is not None and getattr(home, _NAME, None) is not None \
                    and isinstance(getattr(module, "A_log", None), torch.nn.Parameter) \
                    and isinstance(getattr(module, "layer_idx", None), int):
                found.append(module)
        _MIXERS[model] = found
    return found


@contextmanager
def scans_from_cache(model: torch.nn.Module) -> Iterator[None]:
    """Within: every multi-token chunk of ``model``'s mixers scans on from the cached state."""
    found = mixers(model)
    homes = {sys.modules[type(m).__module__] for m in found}
    with ExitStack() as stack:
        for mixer in found:
            stack.enter_context(_hooked(mixer))
        for home in homes:
            stack.enter_context(_installed(home))
        yield


@contextmanager
def _hooked(mixer: torch.nn.Module) -> Iterator[None]:
    handles = [mixer.register_forward_pre_hook(_remember, with_kwargs=True),
               mixer.register_forward_hook(_forget)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _installed(home: ModuleType) -> Iterator[None]:
    with _LOCK:
        users, original = _INSTALLED.get(home, (0, getattr(home, _NAME)))
        if users == 0:
            setattr(home, _NAME, _continuing(original))
        _INSTALLED[home] = (users + 1, original)
    try:
        yield
    finally:
        with _LOCK:
            users, original = _INSTALLED[home]
            if users == 1:
                setattr(home, _NAME, original)
                del _INSTALLED[home]
            else:
                _INSTALLED[home] = (users - 1, original)


def _remember(mixer: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    named = [kwargs[k] for k in ("cache", "cache_params", "past_key_values") if kwargs.get(k) is not None]
    cache = named[0] if named else (args[1] if len(args) > 1 else None)
    state = None if cache is None else recurrent_state(cache, mixer.layer_idx)  # type: ignore[arg-type]
    _PENDING.state = None if state is None else state.clone()  # the cache overwrites it in place after the scan


def _forget(_mixer: torch.nn.Module, _args: tuple, _output: Any) -> None:
    _PENDING.state = None  # a one-token step never calls the scan: never leak its state into another layer


def _continuing(original: Callable[..., Any]) -> Callable[..., Any]:
    def scan(*args: Any, **kwargs: Any) -> Any:
        initial = getattr(_PENDING, "state", None)
        _PENDING.state = None
        if initial is None:  # a prefill from an empty cache, or a call outside kvstate's runs
            return original(*args, **kwargs)
        return scan_from(initial, *args, **kwargs)

    return scan


def scan_from(initial: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
              C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
              delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
              return_last_state: bool = False, **_ignored: Any) -> Any:
    """The selective scan from state ``initial`` ``[B, I, N]``: ``x``, ``dt``, ``z`` ``[B, I, L]``,
    ``A`` ``[I, N]``, ``B``, ``C`` ``[B, N, L]``; returns ``y`` ``[B, I, L]`` (and the last state)."""
    dtype = x.dtype
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B, C = B.transpose(1, 2), C.transpose(1, 2)
    decay = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    inflow = dt[:, :, :, None] * B[:, None, :, :].float() * x[:, :, :, None].float()
    state = initial.to(dtype)
    outputs = []
    for t in range(x.shape[-1]):
        state = decay[:, :, t] * state + inflow[:, :, t]
        outputs.append(torch.matmul(state.to(dtype), C[:, t, :].unsqueeze(-1))[:, :, 0])
    y = torch.stack(outputs, dim=-1)
    if D is not None:
        y = y + x * D[None, :, None]
    if z is not None:
        y = y * F.silu(z)
    return (y, state) if return_last_state else y
