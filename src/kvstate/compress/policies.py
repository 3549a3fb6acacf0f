"""KV compression policies: small validated dataclasses that score slots; wrappers compose.

A policy scores the stored slots of one attention layer (higher = keep) and says how
many to evict (``ratio``; 0 keeps everything, bitwise). Scores see ``ScoreInput``:
keys and values ``[B, H, S, D]``, positions ``[B, S(, R)]`` and, for policies that
watch the model (``Policy.needs``), attention rows ``[B, Hq, W, S]``, the peak
attention each slot received ``[B, Hq, S]``, and pre-RoPE queries. Which slots survive
is the policy's business; where they sit (their logical positions) is recorded by
kvstate, so every policy resumes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InputError


@dataclass(frozen=True)
class Needs:
    """What a policy watches before scoring (``kvstate.compress.observe`` runs it).

    ``rerun``: re-run the state's last ``rerun`` tokens and keep their attention rows;
    ``queries``: also keep their pre-RoPE queries and the RoPE tables of ``future``
    positions after the state; ``reconstruct``: feed the context again after an
    instruction (``prompt``) and keep the peak attention each slot receives.
    """

    rerun: int = 0
    queries: bool = False
    future: int = 0
    reconstruct: bool = False
    prompt: tuple[int, ...] = ()
    chunk: int = 2048

    @property
    def watches(self) -> bool:
        return bool(self.rerun or self.reconstruct)


@dataclass(frozen=True)
class ScoreInput:
    """What a policy may look at for one layer."""

    layer: int
    n_layers: int
    keys: torch.Tensor  # [B, H, S, D]
    positions: torch.Tensor  # [B, S] or [B, S, R]
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


    def scores(self, x: ScoreInput) -> torch.Tensor:
        """``[B, S]`` keep-scores; higher survives."""
        raise NotImplementedError

    def keep_count(self, x: ScoreInput) -> int:
        """Slots to keep: ``ratio`` of the layer's slots evicted, or with ``x.length`` (the kvpress
        meaning) a budget of ``(1 - ratio) * length`` slots, which a short sliding layer may already meet;
        ``x.limit`` (a slot budget) overrides both."""
        S = x.keys.shape[2]
        if x.limit is not None:
            return min(S, x.limit)
        L = S if x.length is None else x.length
        return min(S, L - int(L * self.ratio_for(x.layer, x.n_layers)))


def _attention(x: ScoreInput, policy: Policy) -> torch.Tensor:
    """The observation attention an attention-based policy scores with."""
    if x.attention is None:
        raise InputError(f"{type(policy).__name__} scores from attention weights",
                         expected=f"ScoreInput.attention [B, H, {policy.observation_window}, S]", found=None,
                         fix="let Session.compress compute it, or pass the last queries' attention")
    return x.attention


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
class SnapKV(Policy):
    """Observation-window attention, pooled; the window itself is kept (Li et al. 2024, arXiv:2404.14469)."""

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
        votes = _attention(x, self).float().sum(dim=2).mean(dim=1)  # [B, S]
        pooled = torch.nn.functional.avg_pool1d(votes[:, None], self.kernel, stride=1, padding=self.kernel // 2)[:, 0]
        if x.tail:
            pooled[:, -x.tail:] = float("inf")  # the observation window always stays
        return pooled


@dataclass(frozen=True)
class Wrapper(Policy):
    """Base of the policies that wrap another (kvpress's composition): they watch, ratio and score as
    ``policy`` does, and override only what they change."""

    policy: Policy = field(default_factory=KNorm)

    @property
    def observation_window(self) -> int:
        return self.policy.observation_window

    def needs(self) -> Needs:
        return self.policy.needs()

    def ratio_for(self, layer: int, n_layers: int) -> float:
        return self.policy.ratio_for(layer, n_layers)

    def scores(self, x: ScoreInput) -> torch.Tensor:
        return self.policy.scores(x)


@dataclass(frozen=True)
class PerLayerBudget(Wrapper):
    """PyramidKV-style budgets: lower layers keep more (Cai et al. 2024, arXiv:2406.02069).

    ``ratios`` gives each layer's eviction ratio explicitly; otherwise they grow
    linearly with depth from ``ratio / 2`` to ``3 ratio / 2`` (mean ``ratio``).
    """

    ratios: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ratios is not None and not all(0.0 <= r < 1.0 for r in self.ratios):
            raise InputError("per-layer ratios out of range", expected="each 0 <= r < 1", found=self.ratios)

    def ratio_for(self, layer: int, n_layers: int) -> float:
        if self.ratios is not None:
            if len(self.ratios) != n_layers:
                raise InputError("one ratio per layer", expected=n_layers, found=len(self.ratios))
            return self.ratios[layer]
        depth = layer / max(n_layers - 1, 1)
        return min(self.ratio * (0.5 + depth), 0.95)


@dataclass(frozen=True)
class ReRotate(Wrapper):
    """Move retained keys to contiguous positions by re-applying RoPE by the position delta.

    Opt-in: the new tokens then continue at position ``S`` (the retained count), as in
    StreamingLLM's position shifting, instead of at the true logical position.
    """

    policy: Policy = field(default_factory=StreamingLLM)


@dataclass(frozen=True)
class MediaSpans(Wrapper):
    """Images and videos kept or dropped whole (media state), the rest scored by ``policy``.

    ``keep=True``: no media slot is evicted; ``policy`` evicts its ratio from the other slots (a
    layer keeps at least its media). ``keep=False``: every media slot is evicted, plus what
    ``policy`` picks among the text slots to reach its ratio. Needs layers whose slots still map
    to tokens (not compressed before): ``state.media`` then records which items survived.
    """

    keep: bool = True

    def keep_count(self, x: ScoreInput) -> int:
        media = int(_media(x, self).sum())
        k = self.policy.keep_count(x)
        return max(k, media) if self.keep else min(k, x.keys.shape[2] - media)

    def scores(self, x: ScoreInput) -> torch.Tensor:
        scores = self.policy.scores(x).float().clone()
        scores[:, _media(x, self)] = float("inf") if self.keep else float("-inf")
        return scores


def _media(x: ScoreInput, policy: Policy) -> torch.Tensor:
    if x.media is None:
        raise InputError(f"{type(policy).__name__} needs to know which slots hold media",
                         expected="attention layers whose slots still map to tokens", found="a layer compressed "
                         "before", fix="apply MediaSpans as the first compression of a state")
    return x.media
