"""Attention that also returns each query's log-sum-exp, for scores that need the softmax's normaliser.

KVzip scores a slot by the largest softmax probability any re-read query gave it. With the normaliser
``lse`` of each query in hand that is ``exp(max_r(q_r . k - lse_r))``: one matrix product and one max, no
softmax pass over the whole matrix. PyTorch's CPU flash kernel (a private ``aten`` op) computes the output and
``lse`` in one blocked pass; elsewhere (CUDA float32, a torch without the op) the math runs in row blocks.
"""

from __future__ import annotations

import torch

_ROWS = 512  # query rows materialised at once by the fallback
_GQA: dict[str, bool] = {}  # whether this torch's CPU flash op maps grouped K/V heads itself (asked once)


def attention_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(query key^T * scale) value`` and its log-sum-exp.

    ``query`` ``[B, Hq, q, D]``, ``key`` ``[B, H, k, D]``, ``value`` ``[B, H, k, Dv]`` (``Hq`` a multiple of
    ``H``: query head ``h`` reads K/V head ``h // (Hq / H)``); ``causal`` needs ``q == k``. Returns the output
    ``[B, Hq, q, Dv]`` in the inputs' dtype and ``lse`` ``[B, Hq, q]`` in float32."""
    if causal and query.shape[2] != key.shape[2]:
        raise ValueError(f"causal attention_lse needs as many queries as keys, got {query.shape[2]} and {key.shape[2]}")
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if query.device.type == "cpu" and op is not None and query.dtype in (torch.float32, torch.bfloat16) \
            and value.shape[-1] == query.shape[-1]:  # the op wants one head size
        groups = query.shape[1] // key.shape[1]
        if groups > 1 and not _native_gqa(op):
            key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        out, lse = op(query, key, value, 0.0, causal, scale=scale)[:2]
        return out, lse.float()
    return _math(query, key, value, scale, causal)


def _native_gqa(op: object) -> bool:
    if "cpu" not in _GQA:
        probe = torch.zeros(1, 2, 1, 8)
        try:
            op(probe, probe[:, :1], probe[:, :1], 0.0, False, scale=1.0)  # type: ignore[operator]
            _GQA["cpu"] = True
        except RuntimeError:
            _GQA["cpu"] = False
    return _GQA["cpu"]


def _math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
          causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    B, Hq, q, _ = query.shape
    H, k = key.shape[1], key.shape[2]
    G = Hq // H
    rows = query.float().view(B, H, G, q, -1)
    keys, values = key.float()[:, :, None], value.float()[:, :, None]
    outs, lses = [], []
    for r0 in range(0, q, _ROWS):
        logits = (rows[:, :, :, r0:r0 + _ROWS] @ keys.transpose(-1, -2)).mul_(scale)  # [B, H, G, r, k]
        if causal:
            at = torch.arange(r0, r0 + logits.shape[3], device=query.device)
            later = torch.arange(k, device=query.device)[None, :] > at[:, None]
            logits.masked_fill_(later, float("-inf"))
        lse = logits.logsumexp(-1)
        outs.append(logits.sub_(lse[..., None]).exp_() @ values)
        lses.append(lse)
    out = torch.cat(outs, dim=3).view(B, Hq, q, -1).to(query.dtype)
    return out, torch.cat(lses, dim=3).view(B, Hq, q)
