"""KV compression policies: small validated dataclasses that score slots; wrappers compose.

A policy scores the stored slots of one attention layer (higher = keep) and says how
many to evict (``ratio``; 0 keeps everything, bitwise). Scores see ``ScoreInput``:
keys and values ``[B, H, S, D]``, positions ``[B, S(, R)]`` (``[B, H, S(, R)]`` for a layer
whose heads hold their own slots) and, for policies that watch the model
(``Policy.needs``), attention rows ``[B, Hq, W, S]``, the peak attention each slot
received ``[B, Hq, S]``, KVzip's re-read scores ``[B, H, S]``, or query statistics.

``scores`` returns ``[B, S]`` (one slot set for every head of the layer) or ``[B, H, S]``
(each KV head chooses its own). ``ranking`` says how many survive: None ranks each layer
alone (``keep_count``), a ``Ranking`` ranks every slot of every attention layer and head
together (``kvstate.compress.budget``). Which slots survive is the policy's business; where
they sit (their logical positions) is recorded by kvstate, so every policy resumes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError, UnsupportedError

SLIDING_RANKS = ("whole", "ranked", "recent")
COUNTS = ("entries", "bytes", "padded", "filled")


@dataclass(frozen=True)
class Needs:
    """What a policy watches before scoring (``kvstate.compress.observe`` runs it).

    ``rerun``: re-run the state's last ``rerun`` tokens and keep their attention rows;
    ``prefill``: re-run the whole context from an empty state (every prefill query);
    ``queries``: keep the watched queries (pre-RoPE) and the RoPE tables of ``future``
    positions after the state; ``reconstruct``: feed the context again after an
    instruction (``prompt``; None: the model's own, ``kvstate.compress.template``) and score
    each slot as KVzip does (``softmax="chunk"``) or by the peak attention the model paid it
    (``"model"``); ``weights``: the watched forwards run eager attention to hand out weights;
    ``prefix``: what the re-read does with the chat template's prefix (``KVzip.prefix``).
    """

    rerun: int = 0
    queries: bool = False
    future: int = 0
    reconstruct: bool = False
    prompt: tuple[int, ...] | None = ()
    chunk: int = 2048
    prefill: bool = False
    softmax: str = "model"
    sinks: int = 4
    normalize: bool = False
    prefix: str = "reread"

    @property
    def watches(self) -> bool:
        return bool(self.rerun or self.reconstruct or self.prefill)

    @property
    def weights(self) -> bool:
        """The watched forwards must hand out attention weights (eager attention)."""
        return bool(self.rerun) or (self.reconstruct and self.softmax == "model")


@dataclass(frozen=True)
class Facts:
    """What a policy may check before anything runs (``Policy.check``)."""

    family: str
    position_dims: int  # 1, or R for multimodal RoPE
    media: bool  # the state holds images or videos
    out_projections: bool | None  # every attention layer's output projection is readable (None: not asked)


@dataclass(frozen=True)
class Ranking:
    """One ranking across every attention layer and head (KVzip's global budget).

    ``floor``: each head keeps at least ``floor`` of its share of the budget (Ada-KV's safeguard);
    ``sliding``: ``"whole"`` keeps one kind of layer (sliding-window or full-attention) whole and lets the
    other give the ratio above its floors: the kind that, giving it alone, keeps the larger share of its own
    entries (where neither kind can, every layer is ranked together); ``"ranked"`` always ranks them with the
    others; ``"recent"`` gives the full layers the budget first at every ratio: the sliding layers give
    first, each keeping its newest slots (the ones the next queries' windows still reach), down to their
    floors, then the full layers give the rest in one ranking (without a floor, such a ratio is refused).
    ``count``: what the ratio is of. ``"filled"`` (the default): the bytes held; the ranking, cut short so
    that the layers, each padded to its fullest head, hold ``1 - ratio`` of the
    bytes, then every head fills its layer's row with its own next-best slots (those bytes are held anyway).
    ``"padded"``: the same cut, unfilled (heads keep unequal counts). ``"entries"``: the entries; the ranking
    alone, whose padding then holds more bytes. ``"bytes"``: the bytes, every head of a layer keeping the
    same count (the ranking sets the layer's share), which loses more of the answer (docs/compression.md).
    """

    floor: float = 0.0
    sliding: str = "whole"
    count: str = "filled"


@dataclass(frozen=True)
class ScoreInput:
    """What a policy may look at for one layer (its slots that still matter: a sliding layer's window)."""

    layer: int
    n_layers: int
    keys: torch.Tensor  # [B, H, S, D]
    positions: torch.Tensor  # [B, S(, R)], or [B, H, S(, R)] when per_head
    attention: torch.Tensor | None = None  # [B, Hq, W, S]: attention rows of the watched queries
    media: torch.Tensor | None = None  # [S] bool: the slot holds an image or video token (None: unknown)
    values: torch.Tensor | None = None  # [B, H, S, Dv]
    peak: torch.Tensor | None = None  # [B, Hq, S]: the most attention any watched query paid each slot
    queries: torch.Tensor | None = None  # [B, Hq, W, D]: watched queries with their RoPE undone
    future: tuple[torch.Tensor, torch.Tensor] | None = None  # mean RoPE (cos, sin) [Dr] over future positions
    horizon: tuple[int, int] | None = None  # (first future position, how many) that ``future`` averages over
    window: int | None = None  # the layer's sliding window (None: full attention)
    scaling: float | None = None  # the layer's attention scaling
    tail: int = 0  # trailing slots that are the watched queries' own tokens (a re-run window)
    length: int | None = None  # what the ratio counts: the layer's slots (None) or the whole context
    limit: int | None = None  # an absolute budget of slots per layer, instead of the ratio
    per_head: bool = False  # positions carry a head dim; padding slots have position PAD
    reread: torch.Tensor | None = None  # [B, H, S]: KVzip's score of each slot for each KV head
    moments: tuple[torch.Tensor, torch.Tensor] | None = None  # mean [B, Hq, D] and covariance [B, Hq, D, D]

    @property
    def valid(self) -> torch.Tensor:
        """``[B, H, S]`` bool: the slot holds a token for that head (False on padding)."""
        B, H, S, _ = self.keys.shape
        if not self.per_head:
            return torch.ones(B, H, S, dtype=torch.bool, device=self.keys.device)
        flat = self.positions if self.positions.dim() == 3 else self.positions[..., 0]
        return flat >= 0

    @property
    def time(self) -> torch.Tensor:
        """``[B, H, S]``: each slot's 1-D position per head (the largest component of an M-RoPE one)."""
        flat = self.positions if self.positions.dim() == (3 if self.per_head else 2) else self.positions.amax(-1)
        B, H = self.keys.shape[:2]
        return flat if self.per_head else flat[:, None].expand(B, H, flat.shape[-1])


@dataclass(frozen=True)
class Policy:
    """Base: evict ``ratio`` of each attention layer's slots (0 <= ratio < 1)."""

    ratio: float = 0.5

    def __post_init__(self) -> None:
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0.0 <= self.ratio < 1.0:
            raise InputError("compression ratio out of range", expected="a number, 0 <= ratio < 1",
                             found=repr(self.ratio)[:80], fix="ratio is the fraction of slots to evict; wrappers "
                             "take their inner policy by keyword (policy=...)")

    @property
    def observation_window(self) -> int:
        """Queries whose attention the policy needs (0: none)."""
        return 0

    def needs(self) -> Needs:
        """What to watch before scoring (default: re-run the observation window)."""
        return Needs(rerun=self.observation_window)

    def ratio_for(self, layer: int, n_layers: int) -> float:
        return self.ratio

    def evicts(self, n_layers: int) -> bool:
        """Whether the policy may evict anything (ratio 0 everywhere: the identity, bitwise)."""
        return any(self.ratio_for(i, n_layers) > 0 for i in range(n_layers))

    def ranking(self) -> Ranking | None:
        """None: each layer keeps ``keep_count`` slots per head; a ``Ranking``: one ranking across layers and
        heads decides (``kvstate.compress.budget``)."""
        return None

    def check(self, facts: Facts) -> None:
        """Raise ``UnsupportedError`` before anything runs if the policy cannot run on this model or state."""

    def choose(self, x: ScoreInput) -> torch.Tensor | None:
        """``[B, H, S]`` bool: the slots to keep, chosen outright (``Keep``, ``ChunkKV``); None: by the scores
        and the budget."""
        return None

    def scores(self, x: ScoreInput) -> torch.Tensor:
        """``[B, S]`` keep-scores (every head keeps the same slots) or ``[B, H, S]`` (each head its own);
        higher survives."""
        raise NotImplementedError

    def keep_count(self, x: ScoreInput) -> int:
        """Slots to keep per head: ``ratio`` of the layer's slots evicted, or with ``x.length`` (the kvpress
        meaning) a budget of ``(1 - ratio) * length`` slots, which a short sliding layer may already meet;
        ``x.limit`` (a slot budget) overrides both."""
        S = x.keys.shape[2]
        if x.limit is not None:
            return min(S, x.limit)
        L = S if x.length is None else x.length
        return min(S, L - int(L * self.ratio_for(x.layer, x.n_layers)))


@dataclass(frozen=True)
class Ranked(Policy):
    """A policy whose default is the faithful method: scored per KV head, one ranking across layers and heads.

    ``heads=False`` gives one slot set per layer (the most any head scores a slot); ``scope="layer"``
    ranks each layer alone, as before (``keep_count``); ``floor``, ``sliding`` and ``count``: ``Ranking``.
    """

    heads: bool = True
    scope: str = "global"
    floor: float = 0.0
    sliding: str = "whole"
    count: str = "filled"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scope not in ("global", "layer") or self.sliding not in SLIDING_RANKS \
                or isinstance(self.floor, bool) or not isinstance(self.floor, (int, float)) \
                or not 0.0 <= self.floor <= 1.0 or not isinstance(self.heads, bool) or self.count not in COUNTS:
            raise InputError(f"invalid {type(self).__name__} budget settings",
                             expected=f"scope 'global' or 'layer', sliding one of {SLIDING_RANKS}, 0 <= floor <= 1, "
                             f"heads a bool, count one of {COUNTS}",
                             found={"scope": self.scope, "sliding": self.sliding, "floor": self.floor,
                                    "heads": self.heads, "count": self.count})

    def ranking(self) -> Ranking | None:
        return Ranking(float(self.floor), self.sliding, self.count) if self.scope == "global" else None

    def per_head(self, scores: torch.Tensor) -> torch.Tensor:
        """``[B, H, S]`` scores as the policy hands them out: as they are, or the most any head gives a slot."""
        return scores if self.heads else scores.amax(dim=1)


def _attention(x: ScoreInput, policy: Policy) -> torch.Tensor:
    """The observation attention an attention-based policy scores with."""
    if x.attention is None:
        raise InputError(f"{type(policy).__name__} scores from attention weights",
                         expected=f"ScoreInput.attention [B, H, {policy.observation_window}, S]", found=None,
                         fix="let Session.compress compute it, or pass the last queries' attention")
    return x.attention


def refuse_multimodal(policy: Policy, facts: Facts) -> None:
    """Policies that model RoPE as one angle per position refuse M-RoPE before anything runs."""
    if facts.position_dims != 1:
        raise UnsupportedError(f"{type(policy).__name__} needs 1-D positions", found=f"{facts.family}: "
                               f"multimodal (M-RoPE) positions with {facts.position_dims} components",
                               fix="use KVzip, KNorm or a question-aware policy")


@dataclass(frozen=True)
class StreamingLLM(Policy):
    """Attention sinks + recent window (Xiao et al. 2023, arXiv:2309.17453)."""

    sinks: int = 4

    def scores(self, x: ScoreInput) -> torch.Tensor:
        B, _, S, _ = x.keys.shape
        order = torch.arange(S, dtype=torch.float32, device=x.keys.device).expand(B, S).clone()
        order[:, : self.sinks] = float("inf")
        return order


@dataclass(frozen=True)
class KNorm(Policy):
    """Keep low-L2-norm keys (Devoto et al. 2024, arXiv:2406.11430)."""

    def scores(self, x: ScoreInput) -> torch.Tensor:
        return -x.keys.float().norm(dim=-1).mean(dim=1)


@dataclass(frozen=True)
class Random(Policy):
    """Uniform random eviction, a baseline (seeded)."""

    seed: int = 0

    def scores(self, x: ScoreInput) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1009 + x.layer)
        return torch.rand(x.keys.shape[0], x.keys.shape[2], generator=gen).to(x.keys.device)


@dataclass(frozen=True)
class TOVA(Policy):
    """Keep the slots the last query attends to most (Oren et al. 2024, arXiv:2401.06104)."""

    @property
    def observation_window(self) -> int:
        return 1

    def scores(self, x: ScoreInput) -> torch.Tensor:
        return _attention(x, self).float()[:, :, -1, :].mean(dim=1)


@dataclass(frozen=True)
class SnapKV(Ranked):
    """Observation-window attention, pooled; the window itself is kept (Li et al. 2024, arXiv:2404.14469).

    ``heads=True`` scores each KV head by its own query heads' attention (the paper's and kvpress's per-head
    selection, ``[B, H, S]``); the default, one slot set per layer, averages every head. Each layer evicts
    ``ratio`` of its slots alone (the paper's budget); ``scope="global"`` ranks every layer together under
    ``Ranking``'s rules instead (``floor``, ``sliding``, ``count``): on a hybrid model with
    ``sliding="recent"`` and a ``floor`` the budget goes to the full-attention layers first
    (docs/compression.md, question-aware).
    """

    heads: bool = False
    scope: str = "layer"
    window: int = 16
    kernel: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise InputError("invalid SnapKV settings", expected="window >= 1, odd kernel >= 1",
                             found={"window": self.window, "kernel": self.kernel})

    @property
    def observation_window(self) -> int:
        return self.window

    def scores(self, x: ScoreInput) -> torch.Tensor:
        votes = _attention(x, self).float().sum(dim=2)  # [B, Hq, S]
        B, Hq, S = votes.shape
        H = x.keys.shape[1] if self.heads else 1  # query heads h * Hq / H .. read KV head h (repeat_kv's order)
        votes = votes.view(B, H, Hq // H, S).mean(dim=2).view(B * H, 1, S)
        pooled = torch.nn.functional.avg_pool1d(votes, self.kernel, stride=1, padding=self.kernel // 2).view(B, H, S)
        if x.tail:
            pooled[..., -x.tail:] = float("inf")  # the observation window always stays
        return pooled if self.heads else pooled[:, 0]


def with_sinks(scores: torch.Tensor, x: ScoreInput, sinks: int) -> torch.Tensor:
    """``scores`` ``[B, S]`` or ``[B, H, S]`` with the slots at the first ``sinks`` positions always kept."""
    if not sinks:
        return scores
    time = x.time  # [B, H, S]
    sink = (time >= 0) & (time < sinks)
    return scores.masked_fill(sink if scores.dim() == 3 else sink.all(dim=1), float("inf"))
