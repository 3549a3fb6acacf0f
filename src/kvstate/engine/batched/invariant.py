"""Batch-invariant matrix products: inside ``tiled_linear(rows)`` every product runs on tiles of exactly ``rows`` rows.

A matrix kernel is chosen by the number of rows, so a row's bits over ``M`` rows differ from its bits over
``M'``; for a fixed row count they depend neither on the row's place nor on the other rows (measured:
``docs/batching.md``). So each ``F.linear`` (and an ``[M, K] @ [K, N]`` product: MoE experts over their routed
rows) pads its input to whole tiles and runs one product per tile: a row's bits are the tile kernel's,
whoever shares its forward. A product over one term (RoPE's angles) is exact as it is; any other raises
``Unpackable``. The mode is a ``TorchFunctionMode`` of the calling thread (nothing is patched). It also takes
a census (``uniform``, ``quiet``): whether every product spanned all rows of the forward and nothing selected
rows by value, so the decode can skip the mode's per-operation cost where it changes no bit.

``prepacked`` runs plain ``nn.Linear`` tiles on weights prepacked for the tile (``kernels``), through module
hooks, so forwards with and without the mode make the same calls.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...errors import UnsupportedError
from .kernels import Kernel, tile_kernel
from .packed import Unpackable, attending


def tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
          kernel: Kernel | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed in tiles of ``rows`` rows (``x`` ``[..., K]``, zero-padded). One
    tile is the plain call; a tile of more is called with ``x``'s rank (``[1, .., 1, rows, K]``), as one
    tile would be. With ``kernel`` (``kvstate.engine.batched.kernels``), every tile is ``kernel`` on ``[rows, K]``."""
    K = x.shape[-1]
    if kernel is not None:
        out = tiled_mm(x.reshape(-1, K), weight, rows, lambda tile, _: kernel(tile.contiguous(), bias))
        return out.reshape(*x.shape[:-1], out.shape[-1])
    if x.numel() == rows * K:
        return F.linear(x, weight, bias)
    lead = (1,) * (x.dim() - 2)
    out = tiled_mm(x.reshape(-1, K), weight, rows,
                   lambda tile, w: F.linear(tile.view(*lead, rows, K), w, bias).reshape(rows, -1))
    return out.reshape(*x.shape[:-1], out.shape[-1])


def tiled_mm(a: torch.Tensor, b: torch.Tensor, rows: int,
             product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.mm) -> torch.Tensor:
    """``product(a, b)`` (``a @ b``) for ``a`` ``[M, K]`` and any ``b`` (``[K, N]``, or ``F.linear``'s ``[N, K]``),
    in tiles of ``rows`` rows of ``a`` (zero-padded)."""
    M, pad = a.shape[0], -a.shape[0] % rows
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    tiles = [product(a[i:i + rows], b) for i in range(0, M + pad, rows)]
    return (tiles[0] if len(tiles) == 1 else torch.cat(tiles))[:M]  # one tile: no copy (the head's is large)


def tiled_grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, rows: int) -> torch.Tensor:
    """``grouped_mm``: rows ``[offs[g-1], offs[g])`` of ``a`` ``[S, K]`` times ``b[g]`` ``[K, N]`` (MoE experts),
    each group in tiles of ``rows`` rows."""
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out.append(tiled_mm(a[start:end], b[g], rows))
        start = end
    return torch.cat(out) if out else a.new_zeros(0, b.shape[-1])


def _plain_grouped(args: tuple, kwargs: dict[str, Any]) -> bool:
    """A grouped product of 2-D rows by 3-D expert weights with offsets, nothing else (no bias, no out dtype)."""
    offs = args[2] if len(args) > 2 else kwargs.get("offs")
    rest = {k: v for k, v in kwargs.items() if k != "offs" and v is not None}
    return (len(args) >= 2 and isinstance(offs, torch.Tensor) and args[0].dim() == 2 and args[1].dim() == 3
            and not rest and len(args) <= 3)


_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
_GROUPED = tuple(f for f in (getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None)) if f is not None)
# Selecting rows by value: expert routing, whose products span fewer rows in other forwards.
_ROUTING = {f for name in ("topk", "sort", "argsort", "nonzero", "argwhere", "masked_select", "histc", "bincount",
                           "unique") for f in (getattr(torch, name, None), getattr(torch.Tensor, name, None))
            if f is not None} | {F.one_hot}
_PRODUCTS = {torch.bmm, torch.Tensor.bmm, torch.baddbmm, torch.Tensor.baddbmm, torch.addmm, torch.Tensor.addmm,
             torch.addbmm, torch.Tensor.addbmm, torch.einsum, torch.Tensor.__rmatmul__, *_GROUPED, *_MATMUL}


class TiledLinear(TorchFunctionMode):
    """The mode of ``tiled_linear``; ``uniform``: the census (see the module docstring)."""

    def __init__(self, rows: int, packed: int | None = None) -> None:
        super().__init__()
        self.rows, self.packed = rows, packed
        self.uniform = packed is not None
        self.quiet = True  # nothing was tiled or routed by the mode itself (every product ran in ``prepacked``)

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:  # the mode is off inside this call, so the tiles run the plain kernel
            x, weight, *rest = args
            if x.numel() == 0:  # a module whose rows ``prepacked`` computes (or no rows at all)
                return func(*args, **kwargs)
            self.quiet = False
            bias = rest[0] if rest else kwargs.get("bias")
            self.spans(x.numel() // x.shape[-1])
            return tiled(x, weight, bias, self.rows)
        if func in _PRODUCTS and not attending():
            return self._product(func, args, kwargs)
        if func in _ROUTING and not attending():
            self.uniform = self.quiet = False
        return func(*args, **kwargs)

    def spans(self, rows: int) -> None:
        """The census: a product over ``rows`` rows ran."""
        if rows != self.packed:
            self.uniform = False

    def _product(self, func: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """A matrix product outside attention: tiled when it is ``[M, K] @ [K, N]`` (MoE experts over their
        routed rows), exact as is when it sums over one term (RoPE's angles), refused otherwise."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func in _MATMUL and len(tensors) == 2 and not kwargs and all(t.dim() == 2 for t in tensors):
            self.quiet = False
            self.spans(tensors[0].shape[0])
            return tiled_mm(tensors[0], tensors[1], self.rows)
        if func in (torch.addmm, torch.Tensor.addmm) and len(tensors) == 3 and not kwargs and \
                tensors[0].dim() <= 1 and tensors[1].dim() == tensors[2].dim() == 2:  # GPT-2's Conv1D
            bias, a, b = tensors
            self.quiet = False
            self.spans(a.shape[0])
            return tiled_mm(a, b, self.rows, lambda x, w: torch.addmm(bias, x, w))
        if func in _GROUPED and _plain_grouped(args, kwargs):
            self.uniform = self.quiet = False
            return tiled_grouped(*args[:2], args[2] if len(args) > 2 else kwargs["offs"], self.rows)
        if func in _MATMUL and len(tensors) == 2 and tensors[0].shape[-1] == 1:
            return func(*args, **kwargs)
        self.quiet = False
        raise Unpackable(f"a matrix product ({getattr(func, '__name__', func)}) whose rows the packed forward "
                         "cannot tile", found=[tuple(t.shape) for t in tensors],
                         fix="decode one conversation per forward")


@contextmanager
def tiled_linear(rows: int, packed: int | None = None) -> Iterator[TiledLinear]:
    """Inside, every ``F.linear`` (``nn.Linear`` included) on this thread runs in tiles of ``rows`` rows. With
    ``packed`` (the forward's row count), the mode yielded takes the census (``TiledLinear.uniform``)."""
    with TiledLinear(rows, packed) as mode:
        yield mode


@contextmanager
def prepacked(kernels: Mapping[torch.nn.Module, Kernel], rows: int, mode: TiledLinear | None = None,
              own_rows: Mapping[torch.nn.Module, int] | None = None) -> Iterator[None]:
    """Inside, each module of ``kernels`` (plain ``nn.Linear`` modules, each with its weight's tile kernel from
    ``kvstate.engine.batched.kernels``) computes its rows with that kernel, in tiles of ``rows`` rows (``own_rows``:
    another tile for some modules, made for it), on this thread.

    Module hooks, registered for the ``with`` block only: the pre-hook keeps the input and hands the
    module zero rows, the hook returns the tiled product. Forwards with the tiling ``mode`` and without
    it therefore compute the same bits, and ``mode`` counts the rows for its census."""
    kept: dict[torch.nn.Module, torch.Tensor] = {}
    owner = threading.get_ident()

    def before(module: torch.nn.Module, args: tuple) -> tuple | None:
        if threading.get_ident() != owner or not args or args[0].dim() < 2:
            return None
        kept[module] = args[0]
        return (args[0][..., :0, :], *args[1:])

    def after(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        x = kept.pop(module, None)
        if x is None:
            return None
        if mode is not None:
            mode.spans(x.numel() // x.shape[-1])
        return tiled(x, module.weight, module.bias, (own_rows or {}).get(module, rows), kernels[module])

    handles = [h for m in kernels for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def tile_kernels(linears: list[torch.nn.Module], rows: int, fix: str,
                 own_rows: Mapping[torch.nn.Module, int] | None = None) -> dict[torch.nn.Module, Kernel]:
    """Each linear module's tile kernel for ``rows`` rows (``own_rows``: another tile for some modules; the
    weight prepacked once, then a lookup); modules without one keep ``F.linear``. A machine that cannot hold
    the copy gets a typed error naming ``fix``, before any forward."""
    try:
        found = {module: tile_kernel(module.weight, (own_rows or {}).get(module, rows)) for module in linears}
    except (RuntimeError, MemoryError) as exc:
        raise UnsupportedError("could not prepack the linear weights for the packed forward's tiles",
                               expected="memory for a copy of the linear weights",
                               found=f"{type(exc).__name__}: {str(exc)[:200]}", fix=fix) from exc
    return {module: kernel for module, kernel in found.items() if kernel is not None}


def _widths(model: torch.nn.Module) -> list[Any]:
    """The widths of ``model``'s per-row tensors (hidden, MLP, head, vocabulary); None where the config has none."""
    config = model.config.get_text_config(decoder=True)  # type: ignore[union-attr, operator]
    return [getattr(config, name, None) for name in ("hidden_size", "intermediate_size", "head_dim", "vocab_size")]


def tail_free(model: torch.nn.Module, rows: int) -> bool:
    """Whether ``rows`` rows of every width of ``model`` fill whole 64-element vector blocks (no scalar tail:
    CPU element-wise kernels compute the last ``< 64`` elements of a tensor in a scalar loop)."""
    return all(isinstance(w, int) and rows * w % 64 == 0 for w in _widths(model))


def row_grain(model: torch.nn.Module, threads: int) -> int:
    """The least row count ``g`` such that any multiple of ``g`` rows leaves no scalar tail in any width of
    ``model``, also where an element-wise kernel splits a tensor among up to ``threads`` threads (ATen gives
    each thread an equal share, and each share ends in its own scalar loop); 0 where a width is unknown.
    With every share a whole number of 64-element blocks, an element's bits do not depend on the row count."""
    widths = _widths(model)
    if not all(isinstance(w, int) and w > 0 for w in widths):
        return 0
    block = 64 * math.lcm(*range(1, max(threads, 1) + 1))
    return math.lcm(*(block // math.gcd(w, block) for w in widths))  # type: ignore[arg-type]


_FREE: dict[tuple[Any, ...], bool] = {}  # rows_free's verdicts by kernel code, weight, tile, threads and row count


def rows_free(kernels: Mapping[torch.nn.Module, Kernel], rows: int, counts: Iterable[int]) -> bool:
    """Whether every kernel of ``kernels`` (``tile_kernels``' for tiles of ``rows``), called once on ``m`` rows,
    gives each row the bits of the tiles of ``rows`` rows (zero-padded) for each ``m`` of ``counts``: probed on
    seeded random rows, once per weight shape, dtype, bias, thread count and ``m``. Measured for oneDNN's
    prepacked kernels on this project's CPU (fp32 and bf16, 1-3 threads, the default model's widths and small
    ones, 2 to 512 rows; ``docs/batching.md``): a row's reduction order does not depend on the row count
    there, unlike ``F.linear``'s kernels (and one row, which none of these serves)."""
    threads = torch.get_num_threads()
    for module, kernel in kernels.items():
        weight, bias = module.weight, module.bias
        for m in counts:
            key = (getattr(kernel, "__code__", type(kernel)), tuple(weight.shape), weight.dtype, bias is not None,
                   rows, threads, m)
            if key not in _FREE:
                _FREE[key] = _probe_rows(kernel, weight, bias, rows, m)
            if not _FREE[key]:
                return False
    return True


def _probe_rows(kernel: Kernel, weight: torch.Tensor, bias: torch.Tensor | None, rows: int, m: int) -> bool:
    generator = torch.Generator().manual_seed(m)
    x = torch.randn(m, weight.shape[1], generator=generator).to(weight.dtype)
    with torch.no_grad():
        return torch.equal(kernel(x, bias), tiled_mm(x, weight, rows, lambda tile, _: kernel(tile.contiguous(), bias)))
