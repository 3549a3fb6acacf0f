"""``kvstate verify``: prove the resume contract on a given model, row by row.

Every row continues the same prompt through one kvstate path and compares the
first-step logits and the greedy continuation with a fresh full-prompt run on plain
transformers (``model.generate`` with an explicit full mask). A row passes when the
tokens are identical and max |Δlogit| <= 1e-5 x max |reference logit|.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .session import Session

TOLERANCE = 1e-5  # relative to max |reference logit|, fp32

DEFAULT_PROMPT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the top he "
    "could see the whole bay: the fishing boats returning, the gulls circling the harbour, and "
    "the long line of cliffs fading into the haze. One night he noticed a light where no light "
    "should be, far out beyond the rocks, and he"
)


@dataclass(frozen=True)
class Row:
    """One comparison against the fresh reference."""

    name: str
    description: str
    max_abs: float | None = None
    relative: float | None = None
    cosine: float | None = None
    top1: bool | None = None
    top5_overlap: int | None = None
    greedy_agree: int | None = None
    greedy_total: int | None = None
    error: str | None = None

    @property
    def passed(self) -> bool:
        return (self.error is None and self.relative is not None and self.relative <= TOLERANCE
                and self.greedy_agree == self.greedy_total)


@dataclass
class Report:
    """All rows for one model; ``ok`` is False when any kvstate row failed."""

    model: str
    prompt_tokens: int
    new_tokens: int
    rows: list[Row] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(row.passed for row in self.rows)

    def to_dict(self) -> dict[str, Any]:
        rows = [{**asdict(r), "verdict": "pass" if r.passed else "FAIL"} for r in self.rows]
        return {"model": self.model, "prompt_tokens": self.prompt_tokens,
                "new_tokens": self.new_tokens, "tolerance": TOLERANCE, "ok": self.ok, "rows": rows}

    def table(self, colour: bool = False) -> str:
        head = f"{'check':<28} {'max|Δlogit|':>12} {'relative':>10} {'greedy':>8}  verdict"
        lines = [f"kvstate verify: {self.model}, prompt {self.prompt_tokens} tokens, "
                 f"{self.new_tokens} new", head, "-" * len(head)]
        for r in self.rows:
            verdict = _paint("pass", "32", colour) if r.passed else _paint("FAIL", "31", colour)
            if r.error is not None:
                lines.append(f"{r.name:<28} {'error: ' + r.error[:60]:<33}  {verdict}")
                continue
            lines.append(f"{r.name:<28} {r.max_abs:>12.3e} {r.relative:>10.2e} "
                         f"{r.greedy_agree:>3}/{r.greedy_total:<4}  {verdict}")
        lines.append("all kvstate paths match the fresh run" if self.ok else
                     "MISMATCH: a kvstate path differs from the fresh run")
        return "\n".join(lines)


def _paint(text: str, code: str, colour: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if colour else text


def compare(name: str, description: str, logits: torch.Tensor, tokens: torch.Tensor,
            ref_logits: torch.Tensor, ref_tokens: torch.Tensor) -> Row:
    """Metrics of one path's first-step logits ``[B, V]`` and tokens ``[B, N]``."""
    a, b = logits.float(), ref_logits.float()
    max_abs = (a - b).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
    top5 = min(len(set(x.tolist()) & set(y.tolist()))
               for x, y in zip(a.topk(5).indices, b.topk(5).indices, strict=True))
    n = min(tokens.shape[1], ref_tokens.shape[1])
    agree = int((tokens[:, :n] == ref_tokens[:, :n]).all(0).cumprod(0).sum())
    return Row(name, description, max_abs, max_abs / max(b.abs().max().item(), 1e-30), cosine,
               bool((a.argmax(-1) == b.argmax(-1)).all()), top5, agree, ref_tokens.shape[1])


def _greedy(session: Session, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = session.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                           output_logits=True)
    return out.logits[0], out.sequences


def _checks(model: Any, ids: torch.Tensor, other: torch.Tensor, n: int,
            split: int) -> list[tuple[str, str, Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
    def resume() -> tuple[torch.Tensor, torch.Tensor]:
        s = Session(model)
        s.extend(ids[:, :split])
        return _greedy(s, ids, n)

    def stored() -> tuple[torch.Tensor, torch.Tensor]:
        s = Session(model)
        logits = s.extend(ids)
        return logits, s.generate(ids, max_new_tokens=n, do_sample=False)

    def reset() -> tuple[torch.Tensor, torch.Tensor]:
        s = Session(model)
        s.generate(other, max_new_tokens=4, do_sample=False)
        s.reset()
        s.extend(ids[:, :split])
        return _greedy(s, ids, n)

    def fork() -> tuple[torch.Tensor, torch.Tensor]:
        s = Session(model)
        s.extend(ids[:, :split])
        f = s.fork()
        s.extend(other)  # the original moves on; the fork must not see it
        return _greedy(f, ids, n)

    def truncate() -> tuple[torch.Tensor, torch.Tensor]:
        s = Session(model)
        s.extend(ids[:, :split])  # a call boundary: recurrent layers get a checkpoint here
        s.extend(other[:, :8])
        s.truncate(split)
        return _greedy(s, ids, n)

    def chunked() -> tuple[torch.Tensor, torch.Tensor]:
        s = Session(model, chunk_size=max(2, split // 4))
        s.extend(ids[:, :split])
        return _greedy(s, ids, n)

    def manual() -> tuple[torch.Tensor, torch.Tensor]:
        s = Session(model)
        first = logits = s.extend(ids)
        out = []
        for _ in range(n):
            out.append(logits.argmax(-1, keepdim=True))
            logits = s.extend(out[-1])
        return first, torch.cat(out, 1)

    return [
        ("resume after prefill", "extend(prefix) + generate(full history)", resume),
        ("stored logits", "extend(full) + generate(full): nothing re-fed", stored),
        ("reset after other chat", "another conversation, reset(), then resume", reset),
        ("fork", "fork, original moves on, fork resumes", fork),
        ("truncate", "extend(prefix), extend(8 other), truncate(prefix), resume", truncate),
        ("chunked prefill", "prefix fed in chunks of prefix/4", chunked),
        ("manual decode loop", "extend() one token at a time", manual),
    ]


def verify(model: Any, input_ids: torch.Tensor, *, new_tokens: int = 16, name: str | None = None,
           progress: bool = False) -> Report:
    """Run every check on ``model`` for ``input_ids`` ``[1, L]`` and return the report."""
    from tqdm.auto import tqdm

    L = input_ids.shape[1]
    split = max(1, L - max(2, L // 4))
    ref = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                         do_sample=False, return_dict_in_generate=True, output_logits=True)
    ref_logits, ref_tokens = ref.logits[0], ref.sequences[:, L:]
    other = torch.flip(input_ids[:, 1:], dims=[1])[:, :L // 2 + 1]  # a different conversation
    report = Report(name or type(model).__name__, L, new_tokens)
    checks = _checks(model, input_ids, other, new_tokens, split)
    for check_name, description, run in tqdm(checks, desc="verify", disable=not progress, file=sys.stderr):
        try:
            logits, tokens = run()
        except Exception as exc:  # a crash is a failed row, reported, not a crashed run
            report.rows.append(Row(check_name, description, error=f"{type(exc).__name__}: {exc}"))
            continue
        report.rows.append(compare(check_name, description, logits, tokens, ref_logits, ref_tokens))
    return report
