"""Query-agnostic policies that look ahead: context reconstruction and expected attention (KV compression).

Both score a slot by how much *future* queries are likely to need it, without the
question. ``KVzip`` watches the model re-read its context; ``ExpectedAttention``
models the queries still to come from the statistics of recent ones. Like every
policy they only choose slots: positions stay true, so the result resumes exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from .policies import Needs, Policy, ScoreInput

KVZIP_PROMPT = "\n\nRepeat the previous context exactly.\n"


@dataclass(frozen=True)
class KVzip(Policy):
    """Keep the slots the model attends to when it reconstructs its context
    (Kim et al. 2025, "KVzip", arXiv:2505.23416).

    The context is fed again after ``prompt`` (token ids of an instruction such as
    ``KVZIP_PROMPT``; empty: a plain re-read), ``chunk`` tokens at a time, each chunk
    after the last 8 tokens of the one before. A slot scores the most attention any
    re-reading query, in any head, paid it. The first ``sinks`` slots always stay.
    The re-read costs about one more prefill of the context; its state is discarded.
    """

    prompt: tuple[int, ...] = ()
    chunk: int = 2048
    sinks: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.prompt, tuple) or not all(isinstance(t, int) and t >= 0 for t in self.prompt):
            raise InputError("KVzip prompt must be token ids", expected="a tuple of ints (tokenizer.encode(...))",
                             found=repr(self.prompt)[:80], fix="KVzip(prompt=kvzip_prompt(tokenizer))")
        if self.chunk < 16 or self.sinks < 0:
            raise InputError("invalid KVzip settings", expected="chunk >= 16, sinks >= 0",
                             found={"chunk": self.chunk, "sinks": self.sinks})

    def needs(self) -> Needs:
        return Needs(reconstruct=True, prompt=self.prompt, chunk=self.chunk)

    def scores(self, x: ScoreInput) -> torch.Tensor:
        if x.peak is None:
            raise InputError("KVzip scores from the attention of a reconstruction pass",
                             expected="ScoreInput.peak [B, H, S]", found=None, fix="let Session.compress run it")
        return _with_sinks(x.peak.float().amax(dim=1), x, self.sinks)


def kvzip_prompt(tokenizer: object, text: str = KVZIP_PROMPT) -> tuple[int, ...]:
    """The token ids of KVzip's reconstruction instruction, for ``KVzip(prompt=...)``."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    return tuple(int(t) for t in ids)


@dataclass(frozen=True)
class ExpectedAttention(Policy):
    """Keep the slots that future queries are expected to attend to
    (Devoto et al. 2025, "Expected Attention", arXiv:2510.00636).

    The last ``window`` tokens are re-run to collect their queries with RoPE undone;
    their mean ``mu`` and covariance ``Sigma`` per head, rotated by the average RoPE
    rotation ``R`` of the next ``future`` positions, give each key the expected
    logit ``s * (R mu) . k + s^2 / 2 * k^T (R Sigma R^T) k`` (``s``: the layer's scaling).
    Softmax over the layer's slots, averaged over heads, times the value norm
    (``vnorm``). In a sliding layer a slot counts only for the future positions that
    still see it (a slot about to leave the window is worth little). Queries come from
    the model's own forward, so QK-norm models work.
    """

    window: int = 48
    future: int = 512
    sinks: int = 4
    covariance: bool = True
    vnorm: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 2 or self.future < 1 or self.sinks < 0:
            raise InputError("invalid ExpectedAttention settings", expected="window >= 2, future >= 1, sinks >= 0",
                             found={"window": self.window, "future": self.future, "sinks": self.sinks})

    @property
    def observation_window(self) -> int:
        return self.window

    def needs(self) -> Needs:
        return Needs(rerun=self.window, queries=True, future=self.future)

    def scores(self, x: ScoreInput) -> torch.Tensor:
        if x.queries is None or x.values is None:
            raise InputError("ExpectedAttention scores from watched queries", expected="ScoreInput.queries",
                             found=None, fix="let Session.compress collect them")
        q = x.queries.float()  # [B, Hq, W, D]
        mu = q.mean(dim=2)
        rot = _mean_rotation(x.future, q.shape[-1], q.device)
        mu = mu @ rot.T
        keys = _per_query_head(x.keys.float(), q.shape[1])  # [B, Hq, S, D]
        s = x.scaling if x.scaling is not None else q.shape[-1] ** -0.5
        logits = s * torch.einsum("bhd,bhsd->bhs", mu, keys)
        if self.covariance and q.shape[2] > 1:
            centred = q - q.mean(dim=2, keepdim=True)
            cov = rot @ (centred.transpose(2, 3) @ centred / q.shape[2]) @ rot.T  # [B, Hq, D, D]
            logits = logits + 0.5 * s * s * torch.einsum("bhsd,bhde,bhse->bhs", keys, cov, keys)
        expected = logits.softmax(dim=-1)
        kv_heads = x.keys.shape[1]
        expected = expected.view(expected.shape[0], kv_heads, -1, expected.shape[-1]).mean(dim=2)  # [B, H, S]
        if self.vnorm:
            expected = expected * x.values.float().norm(dim=-1)
        return _with_sinks(expected.mean(dim=1) * _visible(x), x, self.sinks)


def _visible(x: ScoreInput) -> torch.Tensor | float:
    """``[B, S]``: the share of the future horizon during which each slot of a sliding layer stays in
    the window (1 for full attention)."""
    if x.window is None or x.horizon is None:
        return 1.0
    first, count = x.horizon
    flat = x.positions if x.positions.dim() == 2 else x.positions.amax(-1)
    return ((flat + x.window - first) / count).clamp(0.0, 1.0).float()


def _per_query_head(keys: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Keys ``[B, H, S, D]`` repeated for each query head of their group ``[B, Hq, S, D]``."""
    return keys.repeat_interleave(q_heads // keys.shape[1], dim=1)


def _mean_rotation(future: tuple[torch.Tensor, torch.Tensor] | None, dim: int, device: torch.device) -> torch.Tensor:
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


def _with_sinks(scores: torch.Tensor, x: ScoreInput, sinks: int) -> torch.Tensor:
    """``scores`` ``[B, S]`` with the slots at the first ``sinks`` positions always kept."""
    if not sinks:
        return scores
    flat = x.positions if x.positions.dim() == 2 else x.positions.amax(-1)
    return scores.masked_fill(flat < sinks, float("inf"))
