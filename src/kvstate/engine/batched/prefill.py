"""Prefill chunks in tiles: the chunks of many conversations packed into one forward, each with its bits alone.

``Tiled`` runs ``Piece`` s (a conversation's state and its chunk's ids) as one packed forward of batch 1
(``packed``): a piece's rows are a segment of the sequence, products run in tiles of ``rows`` rows
(``invariant``, prepacked where oneDNN has kernels), and each piece attends over its own K/V with a causal
(and sliding-window) mask of its own. So a piece's K/V and logits do not depend on its companions, and a
``Session`` whose chunks run this way (``Settings.prefill_rows``) computes what a ``Scheduler`` computes for
the same history packed with others. The output head runs on the pieces' last rows only, in tiles.

Pieces are attention-only, uncompressed, of batch 1 without padding (``Tiled.fits``); other chunks run as
plain forwards. Whether a family fits is probed once, on two tokens, before any state is labelled with the
tile (``kernels_label``, ``State.canonical_device``); the probe's census lets later forwards skip the tiling
mode and call each prepacked kernel once on all rows (``Tiled._calls``) where that gives the tiles' bits.

Shapes: a piece's ``ids`` ``[1, q]``, ``mask`` ``[1, T + q]``, ``positions`` ``[1, q(, R)]``.
"""

from __future__ import annotations

import weakref
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..._compat.attention import deterministic
from ..._compat.generation import without_logits
from ...layers import AttentionLayerState
from ...state import State
from ..recorder import Forward
from .invariant import prepacked, rows_free, tail_free, tile_kernels, tiled_linear
from .kernels import available
from .packed import PackedCache, Unpackable, packed

if TYPE_CHECKING:
    from ...adapters.binding import Binding, Live, Runtime
    from ...protocols import ModelInputs


class Engine(Protocol):
    """What this module uses of ``kvstate.engine.Engine`` (which imports this module)."""

    model: torch.nn.Module
    binding: Binding
    runtime: Runtime
    cache_kwarg: str
    lock: Any

    def empty(self, batch_size: int, sliding_reserve: int, fingerprint: Any) -> State: ...

    def feed_for(self, state: State, ids: torch.Tensor, mask: torch.Tensor, inputs: ModelInputs) -> Any: ...

    def _advance(self, state: State, fed: torch.Tensor, mask: torch.Tensor, seen: Forward, live: Live) -> State: ...


PREFILL_FIX = "pass prefill_rows=0 (Session, batch_settings; kvstate serve --batch-prefill-rows 0)"
# The output head's tile: a chunk needs its last row's logits only, so the head sees one row per prompt; 16 rows
# are the packed decode's default tile, whose prepacked head (a copy of the vocabulary's weights) serves both.
HEAD_ROWS = 16


def kernels_label(device: str, rows: int) -> str:
    """The name of the kernels a feed's chunks ran on, as states record it (``State.canonical_device``):
    the device type, plus the prefill tile where chunks ran in tiles of ``rows`` rows (read back by
    ``kvstate.settings.tile_of``)."""
    return f"{device}+tile{rows}" if rows else device


@dataclass(frozen=True)
class Piece:
    """One conversation's prefill chunk (see the module docstring); ``logits``: compute its last row's."""

    state: State
    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    logits: bool = True


_TILED: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, bool, bool], Tiled]] = \
    weakref.WeakKeyDictionary()  # per model: every engine (one per Session) shares the probe and the packed weights


def tiled_for(engine: Engine, rows: int, prepack: bool = True, invariant: bool = True) -> Tiled:
    """The ``Tiled`` of ``engine``'s model for tiles of ``rows`` rows (made once per model and setting)."""
    per_model = _TILED.setdefault(engine.model, {})
    key = (rows, prepack, invariant)
    if key not in per_model:
        per_model[key] = Tiled(engine, rows, prepack, invariant)
    return per_model[key]


class Tiled:
    """Prefill chunks in packed forwards with tiles of ``rows`` rows (see the module docstring). Holds no
    engine: every method takes the engine of the model it was made for. ``invariant=False`` packs the
    pieces with plain kernels (``Scheduler(invariant=False)``, the invariance tax's baseline): a piece's
    bits then depend on its companions, and its states say so (``/mixed``)."""

    def __init__(self, engine: Engine, rows: int, prepack: bool = True, invariant: bool = True) -> None:
        self.rows, self.invariant = rows, invariant
        self.linears = [m for m in engine.model.modules() if type(m) is torch.nn.Linear] \
            if invariant and prepack and rows > 1 and available() else []
        self.spare = not tail_free(engine.model, rows)
        head = engine.model.get_output_embeddings() if callable(getattr(engine.model, "get_output_embeddings",
                                                                        None)) else None
        self.head_rows = HEAD_ROWS if invariant else rows
        self.own_rows = {head: self.head_rows} if head in self.linears else {}
        self.head_spare = not tail_free(engine.model, self.head_rows)
        layers = engine.binding.layout.empty_layers(0)
        self.windows = [layer.window if type(layer) is AttentionLayerState else None for layer in layers]
        self._attention = {i for i, layer in enumerate(layers) if type(layer) is AttentionLayerState}
        caps = engine.binding.caps
        family = not caps.stepwise and caps.position_ids and caps.logits_to_keep and \
            len(self._attention) == len(layers)
        self._usable: bool | None = None if family else False
        # the probe's census: every product ran on prepacked weights (none through the tiling mode itself), so
        # later forwards skip the mode's per-operation cost and make the same calls (as the decode's census)
        self.plain = False

    def usable(self, engine: Engine) -> bool:
        """Whether this family's chunks run in tiles: attention-only, and a two-token packed forward (run once,
        on an empty state) went through (else every chunk is a plain forward, and states say so)."""
        if self._usable is None:
            with engine.lock:
                self._usable = self._probe(engine)
        return self._usable

    def label(self, device: str) -> str:
        """The kernels label of chunks run here (``kernels_label``)."""
        suffix = "" if self.linears else "/plain" if self.invariant else "/mixed"
        return kernels_label(device, self.rows) + suffix

    def fits(self, engine: Engine, state: State, ids: torch.Tensor, mask: torch.Tensor, inputs: ModelInputs) -> bool:
        """Whether this chunk runs in tiles (the family is usable, and the chunk is a plain text piece)."""
        if state.batch_size != 1 or state.is_compressed or inputs or not bool(mask.all()) or not self.usable(engine):
            return False
        return not engine.runtime.forward_inputs(state.tokens, ids, inputs)

    def run(self, engine: Engine, pieces: list[Piece]) -> list[State]:
        """The state after each piece, from one packed forward (``last_logits`` set where ``piece.logits``)."""
        return self._run(engine, pieces, verify=False)[0]

    def _run(self, engine: Engine, pieces: list[Piece], verify: bool) -> tuple[list[State], bool]:
        """``run``, and the tiling mode's census (``TiledLinear.quiet``; False without the mode). ``verify``:
        check that every layer attends with the K/V its cache returned (the probe does; the code path is
        the same after, as for the packed decode)."""
        kernels = tile_kernels(self.linears, self.rows, PREFILL_FIX, self.own_rows)  # before any forward
        device = pieces[0].state.device
        lengths = [p.ids.shape[1] for p in pieces]
        starts = [sum(lengths[:i]) for i in range(len(pieces))]
        P = self._padded(sum(lengths), self.rows, self.spare)
        pad = P - sum(lengths)
        ids = torch.cat([*(p.ids for p in pieces), pieces[0].ids.new_zeros(1, pad)], dim=1)
        zeros = pieces[0].positions.new_zeros(1, pad, *pieces[0].positions.shape[2:])
        positions = torch.cat([*(p.positions for p in pieces), zeros], dim=1)
        keep = [s + n - 1 for s, n, p in zip(starts, lengths, pieces, strict=True) if p.logits]
        with ExitStack() as hold:
            lives = [hold.enter_context(engine.runtime.attached(p.state)) for p in pieces]
            cache = PackedCache([live.cache for live in lives], verify=verify,
                                segments=list(zip(starts, lengths, strict=True)), windows=self.windows)
            call = {"input_ids": ids, "position_ids": engine.runtime.model_positions(positions), "use_cache": True,
                    engine.cache_kwarg: cache}
            heads = self._padded(len(keep), self.head_rows, self.head_spare) if keep else 0
            if keep:  # the head's rows in whole tiles of its own, the real ones never last (see ``spare``)
                call["logits_to_keep"] = torch.tensor(keep + [P - 1] * (heads - len(keep)), device=device)
            head = nullcontext() if keep else without_logits(engine.model)
            tiles = tiled_linear(self.rows, P) if self.invariant and not self.plain else nullcontext()
            rows, own = self._calls(kernels, P, heads)
            with engine.lock, torch.no_grad(), deterministic(engine.model), packed(engine.model, cache), \
                    tiles as mode, prepacked(kernels, rows, mode, own), engine.runtime.forward_context(), head:
                out = engine.model(**call)
            quiet = mode is not None and mode.quiet
            if cache.attended != self._attention:
                raise Unpackable(f"{engine.binding.caps.name}: a tiled prefill needs every attention layer to "
                                 "call transformers' attention interface", expected=sorted(self._attention),
                                 found=sorted(cache.attended), fix=PREFILL_FIX)
            logits = iter(out.logits[0, :len(keep)]) if keep else iter(())
            return [engine._advance(p.state, p.ids, p.mask, Forward(p.positions, next(logits)[None].clone()
                                                                  if p.logits else None), live)
                    for p, live in zip(pieces, lives, strict=True)], quiet

    def _calls(self, kernels: dict[torch.nn.Module, Any], P: int, heads: int) -> tuple[int, dict[torch.nn.Module, int]]:
        """The row counts ``prepacked`` calls the kernels with: tiles of ``rows`` (the head's of ``head_rows``),
        or, once the census showed every product on them (``plain``) and ``rows_free`` holds for ``P`` and
        ``heads`` rows, all ``P`` rows (and the head's ``heads``) in one call each: the same bits, the weights
        read once instead of once a tile (``docs/benchmarks.md``)."""
        if not (self.plain and kernels and self.rows < P):
            return self.rows, self.own_rows
        body = {m: k for m, k in kernels.items() if m not in self.own_rows}
        own = {m: k for m, k in kernels.items() if m in self.own_rows}
        if rows_free(body, self.rows, [P]) and (not heads or rows_free(own, self.head_rows, [heads])):
            return P, ({m: heads for m in own} if heads else self.own_rows)
        return self.rows, self.own_rows

    def _padded(self, n: int, rows: int, spare: bool) -> int:
        """Rows of a forward (or head) holding ``n`` real rows: whole tiles of ``rows`` with a spare row where a
        scalar tail could fall on a real one; exactly ``n`` with plain kernels."""
        return rows * -(-(n + spare) // rows) if self.invariant else n

    def _probe(self, engine: Engine) -> bool:
        """Run two tokens in tiles on an empty state; False where the model refuses a packed forward."""
        state = engine.empty(1, 0, None)
        ids = torch.zeros(1, 2, dtype=torch.long, device=state.device)
        mask = torch.ones(1, 2, dtype=torch.bool, device=state.device)
        if engine.runtime.forward_inputs(state.tokens, ids, {}):
            return False
        feed = engine.feed_for(state, ids, mask, {})
        try:
            _, self.plain = self._run(engine, [Piece(state, ids, mask, feed.positions)], verify=True)
        except Unpackable:
            return False
        finally:
            engine.runtime.restore(state.extras)
        return True
