"""Decode steps of many conversations: one packed forward for all (``Packed``), or one forward each (``Single``).

A ``Stream`` is one conversation past its prompt: its prefilled ``State``, the tokens it fed, and what its
decoder keeps between steps. A decoder turns ``n`` streams' next tokens into their logits ``[n, V]`` and, at
the end, a stream into the ``State`` after its answer (every new token but the last, as ``Session.generate``
leaves it).

``Packed`` (attention-only families) is batch-invariant by construction: the forward has ``P`` rows, whole
tiles of ``rows`` (a spare padding row where a width leaves CPU element-wise kernels a scalar tail), its
matrix products run tile by tile (``invariant``; on prepacked weights with ``prepack``, ``kernels``), and each
stream attends over its own K/V with the shapes it has alone (``packed``; streams of a pool in one call where
the padding probe holds, ``pool``). A row's bits are therefore the same alone or batched. Where the first
forward's census shows the tiling mode had nothing to do, and the prepacked kernels give a row its tile's bits
for any row count (``rows_free``, ``row_grain``), a step of fewer streams runs fewer rows: the same bits,
cheaper. A model that cannot be packed raises ``Unpackable`` at its first packed step, before any stream
changed. ``Single`` (recurrent and hybrid families, compressed states) is ``Engine.feed`` per stream.

Shapes: one stream, one row; ``positions`` ``[1, 1(, R)]``; a step's logits ``[n, V]``.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext

import torch

from ..._compat.attention import deterministic
from ...adapters.binding import Live
from ...errors import UnsupportedError
from ...layers import AttentionLayerState
from ...settings import Settings
from ...state import State, next_position_after
from ..core import Engine
from ..recorder import Forward
from ..room import compact, reserve
from .invariant import prepacked, row_grain, rows_free, tail_free, tile_kernels, tiled_linear
from .kernels import Kernel, available
from .packed import PackedCache, Unpackable, packed
from .pool import Pool

__all__ = ["Packed", "Single", "Stream", "Unpackable", "packable"]
PREPACK_FIX = "pass batch_settings(model, prepack=False) to the Scheduler (kvstate serve --batch-prepack off)"


class Stream:
    """One conversation's decode (see the module docstring); ``state`` is the prefilled state until
    ``Single`` replaces it step by step. ``room``: the slots a packed decode reserves for its appends
    (the answer's length; ``kvstate.engine.batched.pool``, or ``kvstate.engine.room`` for a cache it cannot pool)."""

    def __init__(self, state: State, room: int = 0) -> None:
        self.state, self.room = state, room
        self.fed: list[int] = []  # tokens fed so far, in order
        self.positions: list[torch.Tensor] = []  # their positions, [1, 1(, R)] each
        self.next_position = state.next_position
        self.last: torch.Tensor | None = None  # logits row [V] after the last fed token
        self.live: Live | None = None
        self.pool: Pool | None = None  # the decoder's pool it holds a slot of (None: its cache's own room)
        self.slot = 0
        self.hold = ExitStack()  # what keeps ``live`` attached


def packable(engine: Engine, state: State) -> bool:
    """Whether ``state``'s decode can share a forward: attention layers only, uncompressed, positions
    passed explicitly, and a decode token needs no model input but itself."""
    caps = engine.binding.caps
    if caps.stepwise or not caps.position_ids or state.is_compressed or state.batch_size != 1:
        return False
    if not all(type(layer) is AttentionLayerState for layer in state.layers):
        return False
    token = state.tokens.new_zeros(1, 1)
    return not engine.runtime.forward_inputs(state.tokens, token, {})


class Packed:
    """Decode steps of attention-only streams in one forward (see the module docstring)."""

    def __init__(self, engine: Engine, rows: int, invariant: bool = True, prepack: bool = True,
                 fixed: bool = False) -> None:
        self.engine, self.rows, self.invariant, self.fixed = engine, rows, invariant, fixed
        # the tile's products on prepacked weights (kvstate.engine.batched.kernels); never for one-row tiles
        self.linears = [m for m in engine.model.modules() if type(m) is torch.nn.Linear] \
            if invariant and prepack and rows > 1 and available() else []
        self.spare = not tail_free(engine.model, rows)
        self.usable = True  # False once the model refused a packed forward (``Unpackable``)
        self.verified = False  # a packed forward ran with every check (the model's code path is fixed after)
        self.plain = False  # the census: one-tile forwards compute the same bits without the tiling mode
        self.free = False  # the census and the kernels' probe: a step of fewer streams runs fewer rows
        self.grain = 0  # with ``free``: a step's rows are a multiple of this (``row_grain``)
        self._attention = {i for i, layer in enumerate(engine.binding.layout.empty_layers(0))
                           if type(layer) is AttentionLayerState}
        # the streams' K/V in one buffer a layer: one append and one attention call a layer and step (not for
        # one-row tiles, whose attention stays Session's decode)
        self.pooling = rows > 1 or not invariant
        self.pools: dict[int, Pool] = {}  # by length class: a long stream does not make every slot as long

    def step(self, streams: list[Stream], tokens: list[int]) -> torch.Tensor:
        """Feed ``tokens[i]`` to ``streams[i]``; the logits ``[n, V]`` after them (row ``i``: stream ``i``)."""
        kernels = self._kernels()  # before the forward: nothing of a refused packing reaches a stream
        engine, n = self.engine, len(streams)
        P = self._rows(n)
        device = streams[0].state.device
        ids = torch.zeros(1, P, dtype=torch.long, device=device)
        ids[0, :n] = torch.tensor(tokens, dtype=torch.long, device=device)
        ones = torch.ones(1, 1, dtype=torch.bool, device=device)
        own = [engine.binding.inputs.positions(s.next_position, ids[:, i:i + 1], ones, {})
               for i, s in enumerate(streams)]
        positions = torch.cat([*own, *[torch.zeros_like(own[0])] * (P - n)], dim=1)
        # the grouped decode attention for all but one-row tiles (Session's decode, bit for bit)
        caches = [self._live(s).cache for s in streams]
        pooled = [pool.step([s.slot if s.pool is pool else None for s in streams])
                  for pool in {id(s.pool): s.pool for s in streams if s.pool is not None}.values()]
        cache = PackedCache(caches, verify=not self.verified, grouped=self.rows > 1 or not self.invariant,
                            steps=pooled)
        call = {"input_ids": ids, "position_ids": engine.runtime.model_positions(positions), "use_cache": True,
                engine.cache_kwarg: cache}
        tiles = tiled_linear(self.rows, P) if self.invariant and (self.rows < P or not self.plain) else nullcontext()
        try:
            with engine.lock, torch.no_grad(), deterministic(engine.model), packed(engine.model, cache), \
                    tiles as mode, prepacked(kernels, min(P, self.rows), mode):
                logits = engine.model(**call).logits[0, :n]  # [n, V]
            self._check(cache)
            if not self.verified and mode is not None:
                self.plain = mode.uniform
                self.free = self._free(mode.uniform and mode.quiet, kernels)
            self.verified = True
        except Unpackable:
            self._give_up(streams)
            raise
        for step in pooled:
            step.commit()
        for i, s in enumerate(streams):
            s.fed.append(tokens[i])
            s.positions.append(own[i])
            s.next_position = next_position_after(own[i], ones, s.next_position)
            s.last = logits[i]  # a view: cloned once, by finish
        return logits

    def finish(self, stream: Stream) -> State:
        """The state after the stream's fed tokens (its K/V read back from its cache, as ``Engine`` reads a
        ``generate``'s)."""
        state = stream.state
        if not stream.fed:
            self.close(stream)
            return state
        assert stream.live is not None and stream.last is not None
        fed = torch.tensor([stream.fed], dtype=torch.long, device=state.device)
        mask = torch.ones(1, state.tokens_seen + len(stream.fed), dtype=torch.bool, device=state.device)
        seen = Forward(torch.cat(stream.positions, dim=1), stream.last[None].clone())  # not the step's [n, V]
        self._unpool(stream, keep=True)
        try:
            return self.engine._advance(state, fed, mask, seen, stream.live)
        finally:
            stream.hold.close()

    def close(self, stream: Stream) -> None:
        self._unpool(stream, keep=False)
        stream.hold.close()

    def _live(self, stream: Stream) -> Live:
        if stream.live is None:
            stream.live = stream.hold.enter_context(self.engine.runtime.attached(stream.state))
            if self.pooling and Pool.poolable(stream.live.cache):
                stream.pool = self.pools.setdefault(Pool.length_class(stream.live.cache, stream.room), Pool(self.fixed))
                stream.slot = stream.pool.join(stream.live.cache, stream.room)
            else:
                reserve(stream.live.cache, stream.room)
        return stream.live

    def _unpool(self, stream: Stream, keep: bool) -> None:
        """The stream's K/V back in its own cache (``keep``; contiguous either way) and its slot freed."""
        if stream.pool is None:
            if keep and stream.live is not None:
                compact(stream.live.cache)
        elif keep and stream.live is not None:
            stream.pool.leave(stream.slot, stream.live.cache)
        else:
            stream.pool.release(stream.slot)
        stream.pool = None

    def _rows(self, n: int) -> int:
        """The rows of a step of ``n`` streams: ``n`` with plain kernels; else whole tiles of ``rows`` (with the
        spare row), or, once ``free``, for ``n`` up to a tile, the least multiple of ``grain`` (at least 2)."""
        if not self.invariant:
            return n
        if self.free:
            P = self.grain * -(-max(n, 2) // self.grain)
            if self.rows >= P:
                return P
        return self.rows * -(-(n + self.spare) // self.rows)

    def _free(self, prepacked_only: bool, kernels: dict[torch.nn.Module, Kernel]) -> bool:
        """After the first forward's census: whether every product ran on the prepacked kernels, those give a
        row the same bits for any 2 to ``rows`` rows (``rows_free``), and element-wise kernels leave no tail at
        any multiple of ``grain`` that divides the tile (``row_grain``)."""
        self.grain = row_grain(self.engine.model, torch.get_num_threads())
        return (prepacked_only and bool(kernels) and self.grain > 0 and self.rows % self.grain == 0
                and rows_free(kernels, self.rows, range(2, self.rows)))

    def _kernels(self) -> dict[torch.nn.Module, Kernel]:
        """The tiles' kernels, made before the forward: nothing of a refused packing reaches a stream."""
        return tile_kernels(self.linears, self.rows, PREPACK_FIX)

    def _check(self, cache: PackedCache) -> None:
        """Every attention layer ran through the packed attention (else the rows saw each other)."""
        if cache.attended != self._attention:
            raise Unpackable(f"{self.engine.binding.caps.name}: a packed decode needs every attention layer to call "
                             "transformers' attention interface", expected=sorted(self._attention),
                             found=sorted(cache.attended), fix="decode one conversation per forward")

    def _give_up(self, streams: list[Stream]) -> None:
        """After a refused first forward: never pack again, and drop the caches it half filled (each stream's
        ``state`` is still its prefilled state, so ``Single`` continues it)."""
        self.usable = False
        for stream in streams:
            if stream.fed:  # a model that packed before and refuses now: nothing to fall back on
                raise UnsupportedError("a packed decode failed after earlier packed steps",
                                       found=self.engine.binding.caps.name, fix="use max_batch=1")
            self.close(stream)
            stream.live = None


class Single:
    """Decode steps one stream per forward, through ``Engine.feed`` (see the module docstring)."""

    def __init__(self, engine: Engine, settings: Settings) -> None:
        self.engine, self.settings = engine, settings

    def step(self, streams: list[Stream], tokens: list[int]) -> torch.Tensor:
        rows = []
        for stream, token in zip(streams, tokens, strict=True):
            state = stream.state
            ids = torch.tensor([[token]], dtype=torch.long, device=state.device)
            mask = torch.ones(1, state.tokens_seen + 1, dtype=torch.bool, device=state.device)
            stream.state = self.engine.feed(state, self.engine.feed_for(state, ids, mask, {}), self.settings)
            stream.fed.append(token)
            rows.append(stream.state.last_logits[0])  # type: ignore[index]
        return torch.stack(rows)

    def finish(self, stream: Stream) -> State:
        return stream.state

    def close(self, stream: Stream) -> None:
        """Nothing is held between steps."""
