"""``verify()``: run the generation-equivalence control matrix and its diagnosis on one model.

Every row continues the same prompt through one path and compares first-step logits
and greedy tokens with a fresh full-sequence run on plain transformers. kvstate rows
must match (max |Δlogit| <= 1e-5 x max |reference logit|, identical tokens); plain
rows show, for contrast, where the usual way of resuming breaks on this model. The
diagnosis follows the long seed's decision tree (see ``diagnose``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch

from .._compat import attention
from .._compat.core import attention_implementation
from ..errors import InputError
from ..selfcheck import adapter_for
from .compressed import compression_rows
from .contract import (
    boundary_rows,
    contract_rows,
    kvstate_path_rows,
    multimodal_rows,
    padded_row,
    sliding_row,
    video_rows,
)
from .diagnose import diagnose
from .faults import FAULTS
from .report import Report
from .rows import Matrix, cache_variant_rows, plain_rows, repeat_row

DEFAULT_PROMPT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the top he "
    "could see the whole bay: the fishing boats returning, the gulls circling the harbour, and "
    "the long line of cliffs fading into the haze. One night he noticed a light where no light "
    "should be, far out beyond the rocks, and he"
)

_STEPS = (repeat_row, cache_variant_rows, plain_rows, kvstate_path_rows, boundary_rows, contract_rows, compression_rows,
          sliding_row, padded_row, multimodal_rows, video_rows)


def verify(model: Any, input_ids: torch.Tensor, *, new_tokens: int = 16, name: str | None = None,
           fresh: Callable[[], Any] | None = None, spec: str | None = None, fault: str | None = None,
           quick: bool = False, progress: bool = False) -> Report:
    """Run the control matrix on ``model`` for ``input_ids`` ``[1, L]``.

    Args:
        fresh: builds a new instance with the same weights (fresh-instance rows).
        spec: a model spec (``default``, ``tiny:<type>``, a folder) for the another-process row.
        fault: plant one known bug in the kvstate rows (one of ``FAULTS``), to see the diagnosis.
        quick: skip the slowest rows (another process, long sliding-window prompt).
    """
    from tqdm.auto import tqdm

    if fault is not None and fault not in FAULTS:
        raise InputError("unknown fault to inject", expected=FAULTS, found=fault)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 4:
        raise InputError("verify needs one prompt of at least 4 tokens", expected="[1, L >= 4]",
                         found=tuple(input_ids.shape), fix="pass a longer prompt")
    if fault == "zero-rope-deltas" and (adapter_for(model).synthetic_image(model) is None or fresh is None):
        raise InputError("the zero-rope-deltas fault needs a multimodal model and a fresh instance",
                         expected="a Qwen-VL model and fresh=...", found=type(model).__name__)
    attn = attention_implementation(model)
    with ExitStack() as planted:
        if fault == "nondeterministic-attention":  # run-dependent noise in every attention output, fresh models too
            planted.enter_context(attention.noisy(model))
            fresh = None if fresh is None else _noisy(fresh, planted)
        matrix = Matrix(model, input_ids, new_tokens, fresh=fresh, spec=spec, attn=attn, fault=fault, quick=quick)
        for step in tqdm(_STEPS, desc="verify", disable=not progress, file=sys.stderr):
            step(matrix)
    weight = next(model.parameters())
    return Report(name or type(model).__name__, str(attn), input_ids.shape[1], new_tokens, matrix.rows,
                  diagnose(matrix.rows, matrix.determinism), matrix.skipped,
                  dtype=str(weight.dtype).removeprefix("torch."), device=str(weight.device), floor=matrix.floor,
                  determinism=matrix.determinism)


def _noisy(fresh: Callable[[], Any], stack: ExitStack) -> Callable[[], Any]:
    """``fresh``, whose models run with the planted noise while ``stack`` is open."""
    def build() -> Any:
        model = fresh()
        stack.enter_context(attention.noisy(model))
        return model

    return build
