"""Which kernels make a row's bits depend on its batch, on this machine (``docs/batching.md``).

* ``linear``: a row of ``F.linear(X[:M], W)`` against the same row with ``M = 1`` and ``M = 64``, for
  each ``M``; and, for a fixed tile of ``T`` rows, whether a row's result depends on its place in the
  tile, on the other rows' contents, or on zero padding (what ``kvstate.engine.batched.invariant`` relies on);
* ``prepacked``: the same fixed-tile checks for the prepacked oneDNN kernel the packed decode uses
  (``kvstate.engine.batched.kernels``), and the time of one 16-row tile by each weight (the output layer's
  262144 x 640 included) with ``F.linear`` and with the prepacked kernel; and the body's products of 16
  short prompts prefilled one by one, in one product, or in prepacked tiles (``prefill_body``);
* ``elementwise``: element-wise kernels on ``[P, H]`` at ``P = 1`` against inside ``P`` rows, and, with
  ``P`` fixed, which rows differ from row 0 (the vector loop's scalar tail).

    python bench/batch_kernels.py        # a minute; writes bench/results/batch_kernels.json
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results

ROWS = (1, 2, 3, 4, 5, 7, 8, 12, 16, 24, 32, 48, 64)
SHAPES = ((640, 2048), (2048, 640), (640, 8192))  # (K, N): the default model's widths
TILES = (4, 8, 16, 32, 64)
OPS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "exp": torch.exp, "cos": torch.cos,
       "tanh": torch.tanh, "rsqrt": torch.rsqrt, "softmax": lambda x: x.softmax(-1),
       "rms": lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)}


def by_rows(W: torch.Tensor, X: torch.Tensor) -> dict[int, str]:
    """Per ``M``: '1' if rows equal the one-row result, '6' if equal to the 64-row result, '-' otherwise."""
    alone = torch.stack([F.linear(X[i:i + 1], W)[0] for i in range(64)])
    full = F.linear(X, W)
    out = {}
    for M in ROWS:
        part = F.linear(X[:M], W)
        out[M] = ("1" if torch.equal(part, alone[:M]) else "-") + ("6" if torch.equal(part, full[:M]) else "-")
    return out


def product(W: torch.Tensor, T: int, prepacked: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x [T, K] -> x @ W.T``: ``F.linear``, or the packed decode's prepacked kernel for tiles of ``T`` rows."""
    from kvstate.engine.batched.kernels import tile_kernel

    kernel = tile_kernel(W, T) if prepacked else None
    if prepacked and kernel is None:
        raise SystemExit("this torch has no oneDNN linear kernels")
    return (lambda x: kernel(x, None)) if kernel is not None else (lambda x: F.linear(x, W))


def tile(W: torch.Tensor, X: torch.Tensor, T: int, gen: torch.Generator, prepacked: bool = False) -> dict[str, bool]:
    f = product(W, T, prepacked)
    base = f(X[:T])
    place = all(torch.equal(torch.roll(f(torch.roll(X[:T], k, 0)), -k, 0), base) for k in range(1, T))
    others = X[:T].clone()
    others[1:] = torch.randn(T - 1, X.shape[1], generator=gen).to(X.dtype)
    content = torch.equal(f(others)[0], base[0])
    others[1:] = 0
    return {"place": place, "other_rows": content, "zero_padding": torch.equal(f(others)[0], base[0])}


def milliseconds(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, repeat: int) -> float:
    f(x)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        f(x)
        times.append(time.perf_counter() - start)
    return round(1000 * statistics.median(times), 3)


def prepacked(dtype: torch.dtype) -> dict[str, object]:
    gen = torch.Generator().manual_seed(2)
    invariant, cost = [], []
    for K, N in (*SHAPES, (640, 262144)):
        W, X = torch.randn(N, K, generator=gen).to(dtype), torch.randn(64, K, generator=gen).to(dtype)
        if N < 262144:
            invariant.append({"K": K, "N": N, "fixed_tile_invariant": {T: all(tile(W, X, T, gen, True).values())
                                                                       for T in TILES}})
        repeat = 5 if N == 262144 else 50
        cost.append({"K": K, "N": N, "rows": 16, "F.linear_ms": milliseconds(product(W, 16, False), X[:16], repeat),
                     "prepacked_ms": milliseconds(product(W, 16, True), X[:16], repeat)})
    return {"invariant": invariant, "tile_of_16_cost": cost}


def linear(dtype: torch.dtype) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for K, N in SHAPES:
        W, X = torch.randn(N, K, generator=gen).to(dtype), torch.randn(64, K, generator=gen).to(dtype)
        rows.append({"K": K, "N": N, "by_rows": by_rows(W, X),
                     "fixed_tile_invariant": {T: all(tile(W, X, T, gen).values()) for T in TILES}})
    return rows


LAYER = ((640, 1024), (640, 256), (640, 256), (1024, 640), (640, 2048), (640, 2048), (2048, 640))  # (K, N)


def prefill_body(dtype: torch.dtype, prompts: int = 16, length: int = 22) -> dict[str, float]:
    """The body's products of the default model (18 layers, weights from memory) for ``prompts`` prompts of
    ``length`` tokens: each prompt alone with ``F.linear`` (today's canonical prefill), all rows in one
    ``F.linear`` per weight (what transformers' continuous batching does), and all rows in prepacked tiles of
    ``T`` rows (a packed prefill that keeps each prompt's bits: docs/batching.md, "Where continuous batching
    still wins"); and one prompt alone in one prepacked tile. Milliseconds."""
    gen = torch.Generator().manual_seed(3)
    weights = [[torch.randn(N, K, generator=gen).to(dtype) for K, N in LAYER] for _ in range(18)]

    def body(rows: int, times: int, T: int | None = None) -> float:
        x = {K: torch.randn(T or rows, K, generator=gen).to(dtype) for K in (640, 1024, 2048)}
        calls = [[product(W, T, True) if T else (lambda v, W=W: F.linear(v, W)) for W in layer] for layer in weights]
        tiles = -(-rows // T) if T else 1

        def run(_: torch.Tensor) -> torch.Tensor:
            for _ in range(times * tiles):
                for layer, fs in zip(weights, calls, strict=True):
                    for W, f in zip(layer, fs, strict=True):
                        f(x[W.shape[1]])
            return x[640]

        return milliseconds(run, x[640], 3)

    total = prompts * length
    out = {"each_prompt_alone_F.linear": body(length, prompts), "all_rows_one_F.linear": body(total, 1)}
    out.update({f"all_rows_prepacked_tiles_of_{T}": body(total, 1, T) for T in (32, 64, 128)})
    out["one_prompt_F.linear"] = body(length, 1)
    out.update({f"one_prompt_prepacked_tile_of_{T}": body(length, 1, T) for T in (32, 64)})
    return {"prompts": prompts, "length": length, **out}


def elementwise(dtype: torch.dtype) -> dict[str, object]:
    gen = torch.Generator().manual_seed(1)
    one_row, fixed = [], []
    for H in (8, 10, 40, 200, 256, 640):
        for P in (4, 16):
            for name, op in OPS.items():
                x = torch.rand(1, H, generator=gen).to(dtype) + 0.1
                rows = []
                for place in range(P):
                    y = torch.rand(P, H, generator=gen).to(dtype) + 0.1
                    y[place] = x[0]
                    rows.append(op(y)[place])
                if not torch.equal(rows[0], op(x)[0]):
                    one_row.append(f"{name} H={H} P={P}")
                odd = [k for k in range(P) if not torch.equal(rows[k], rows[0])]
                if odd:
                    fixed.append(f"{name} H={H} P={P} rows {odd}")
    return {"differs_from_one_row": one_row, "differs_from_row_0_at_fixed_P": fixed}


def main() -> None:
    result: dict[str, object] = {"cpu_capability": torch.backends.cpu.get_cpu_capability()}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            key = f"{str(dtype).removeprefix('torch.')}_threads{threads}"
            result[key] = {"linear": linear(dtype), "prepacked": prepacked(dtype), "elementwise": elementwise(dtype)}
            print(key, result[key]["prepacked"]["tile_of_16_cost"], flush=True)  # type: ignore[index]
            if threads == 2:
                result[key]["prefill_body_ms"] = prefill_body(dtype)  # type: ignore[index]
                print(key, result[key]["prefill_body_ms"], flush=True)  # type: ignore[index]
    write_results("batch_kernels", result)


if __name__ == "__main__":
    main()
