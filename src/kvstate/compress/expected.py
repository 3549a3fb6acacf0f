"""Expected Attention: keep the slots that future queries are expected to attend to
(Devoto et al. 2025, arXiv:2510.00636), as kvpress 0.5.5 computes it.

The queries of the whole prefill (pre-RoPE, after any QK-norm, the first ``sinks``
positions left out) give a mean ``mu`` and covariance ``Sigma`` per query head; the
average RoPE rotation ``R`` of the ``future`` positions after the context turns them
into ``R mu`` and ``R Sigma R^T``. Each key's expected logit is
``s (R mu).k + s^2/2 k^T (R Sigma R^T) k`` (``s``: the layer's scaling, ``1/sqrt(d)`` on the
models kvpress runs), softmaxed over the layer's non-sink slots, averaged over the query
heads of each KV head, then ``(score + epsilon) * ||v||``. The first ``sinks`` slots always
stay. By default every KV head is scored apart and one ranking across layers and heads
decides, with Ada-KV's floor of 20% (``Ranking``). In a sliding layer a slot counts only
for the future positions that still see it. Queries come from the model's own forward, so
QK-norm models work; M-RoPE (Qwen-VL) is refused before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError, UnsupportedError
from .policies import Facts, Needs, Ranked, ScoreInput, refuse_multimodal, with_sinks


@dataclass(frozen=True)
class ExpectedAttention(Ranked):
    """Expected Attention (see the module docstring). ``ExpectedAttention(0.5)`` is kvpress's method with
    Ada-KV's floor, ranked across layers.

    Args:
        window: None, every prefill query (re-runs the context from an empty state: one more prefill); ``N``,
            the last ``N`` tokens re-run (kvstate's earlier fit, from a state that can roll back that far).
        future, sinks, covariance, vnorm, epsilon: kvpress's ``n_future_positions``, ``n_sink``,
            ``use_covariance``, ``use_vnorm``, ``epsilon``.
        heads, scope, floor, sliding: ``Ranked``. ``ExpectedAttention(r, window=48, epsilon=0.0, heads=False,
            scope="layer")`` is kvstate's earlier ExpectedAttention.
    """

    window: int | None = None
    future: int = 512
    sinks: int = 4
    covariance: bool = True
    vnorm: bool = True
    epsilon: float = 1e-2
    floor: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.window is not None and (isinstance(self.window, bool) or self.window < 2)) or self.future < 1 \
                or self.sinks < 0 or not self.epsilon >= 0:
            raise InputError("invalid ExpectedAttention settings",
                             expected="window None or >= 2, future >= 1, sinks >= 0, epsilon >= 0",
                             found={"window": self.window, "future": self.future, "sinks": self.sinks,
                                    "epsilon": self.epsilon})

    @property
    def observation_window(self) -> int:
        return self.window or 0

    def needs(self) -> Needs:
        if self.window is None:
            return Needs(prefill=True, queries=True, future=self.future, sinks=self.sinks)
        return Needs(rerun=self.window, queries=True, future=self.future)

    def check(self, facts: Facts) -> None:
        refuse_multimodal(self, facts)
        if self.window is None and facts.media:
            raise UnsupportedError("ExpectedAttention re-runs the whole prefill, and this state holds images or "
                                   "videos whose pixels it no longer has", found=f"{facts.family} with media",
                                   fix="use ExpectedAttention(window=N) within the text after the media, or KVzip")

    def scores(self, x: ScoreInput) -> torch.Tensor:
        if x.values is None or (x.moments is None and x.queries is None):
            raise InputError("ExpectedAttention scores from watched queries", expected="ScoreInput.moments or "
                             "ScoreInput.queries", found=None, fix="let Session.compress collect them")
        mu, cov = _statistics(x, self.covariance)
        rot = mean_rotation(x.future, mu.shape[-1], mu.device)
        mu = mu @ rot.T
        keys = _per_query_head(x.keys.float(), mu.shape[1])  # [B, Hq, S, D]
        s = x.scaling if x.scaling is not None else mu.shape[-1] ** -0.5
        logits = s * torch.einsum("bhd,bhsd->bhs", mu, keys)
        if cov is not None:
            cov = rot @ cov @ rot.T  # [B, Hq, D, D]
            logits = logits + 0.5 * s * s * torch.einsum("bhsd,bhde,bhse->bhs", keys, cov, keys)
        sink = (x.time >= 0) & (x.time < self.sinks)  # [B, H, S]
        hidden = _per_query_head(~x.valid | sink, mu.shape[1])  # sinks sit out of the softmax, as in kvpress
        expected = logits.masked_fill(hidden, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        kv_heads = x.keys.shape[1]
        expected = expected.view(expected.shape[0], kv_heads, -1, expected.shape[-1]).mean(dim=2)  # [B, H, S]
        if self.vnorm:
            expected = (expected + self.epsilon) * x.values.float().norm(dim=-1)
        scores = expected * _visible(x)
        return with_sinks(scores if self.heads else scores.mean(dim=1), x, self.sinks)


def _statistics(x: ScoreInput, covariance: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``mu`` ``[B, Hq, D]`` and ``Sigma`` ``[B, Hq, D, D]`` (None without covariance) of the watched queries."""
    if x.moments is not None:
        mu, cov = x.moments
        return mu.float(), cov.float() if covariance else None
    q = x.queries.float()  # type: ignore[union-attr]  # [B, Hq, W, D]
    mu = q.mean(dim=2)
    if not covariance or q.shape[2] < 2:
        return mu, None
    centred = q - mu[:, :, None]
    return mu, centred.transpose(2, 3) @ centred / q.shape[2]


def _visible(x: ScoreInput) -> torch.Tensor | float:
    """``[B, H, S]``: the share of the future horizon during which each slot of a sliding layer stays in
    the window (1 for full attention)."""
    if x.window is None or x.horizon is None:
        return 1.0
    first, count = x.horizon
    return ((x.time + x.window - first) / count).clamp(0.0, 1.0).float()


def _per_query_head(t: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``[B, H, ...]`` repeated for each query head of its group: ``[B, Hq, ...]``."""
    return t.repeat_interleave(q_heads // t.shape[1], dim=1)


def mean_rotation(future: tuple[torch.Tensor, torch.Tensor] | None, dim: int, device: torch.device) -> torch.Tensor:
    """The average RoPE rotation ``[D, D]`` over future positions (identity without RoPE).

    RoPE rotates ``q`` to ``q * cos + rotate_half(q) * sin``; averaged over positions that
    is ``q * mean(cos) + rotate_half(q) * mean(sin)``, a linear map; dims past the rotary
    ones (partial RoPE) are left as they are.
    """
    rot = torch.eye(dim, device=device)
    if future is None:
        return rot
    cos, sin = future[0].to(device), future[1].to(device)
    r = cos.shape[-1]
    half = torch.zeros(r, r, device=device)  # rotate_half as a matrix: [x1, x2] -> [-x2, x1]
    half[: r // 2, r // 2:] = -torch.eye(r // 2, device=device)
    half[r // 2:, : r // 2] = torch.eye(r // 2, device=device)
    rot[:r, :r] = torch.diag(cos) + torch.diag(sin) @ half
    return rot
