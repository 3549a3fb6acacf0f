"""Rows, reports and their renderings (terminal table, Markdown, JSON).

A row compares one path's first-step logits ``[B, V]`` and greedy tokens ``[B, N]``
with the fresh reference (plain ``model.generate``). ``group`` says whose path it is:
``kvstate`` rows must pass; ``plain`` rows document what plain transformers does and
never fail a run. ``facts`` records the conditions of the row (mask given, positions
given, instance, K/V identical, token re-fed), which is what the diagnosis reasons about.

What "equal" means (the canonical schedule): a kvstate row must be **bitwise** equal to the kvstate
cold run (a new ``Session`` on the same history: the same computation, so the same
bits), where the row follows the canonical schedule; and within the **noise floor**
of plain transformers against itself (the same history prefilled whole and split,
``Floor``) of the fresh reference. The floor's own greedy tokens may disagree with
the reference in low precision; then only the bitwise comparison judges the tokens.
In float32 the floor is far below ``TOLERANCE`` x max |reference logit|, the old rule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

TOLERANCE = 1e-5  # relative to max |reference logit|, fp32
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Row:
    """One comparison against the fresh reference."""

    name: str
    group: str  # "kvstate" or "plain"
    description: str
    max_abs: float | None = None
    relative: float | None = None
    cosine: float | None = None
    top1: bool | None = None
    top5_overlap: int | None = None
    greedy_agree: int | None = None
    greedy_total: int | None = None
    error: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    bitwise: bool | None = None  # equal to the kvstate cold run (None: not a canonical path)
    allowed: float | None = None  # max |Δlogit| allowed against the reference (the floor, at least fp32's rule)
    tokens_required: bool = True  # False where the floor's own greedy tokens disagree with the reference

    @property
    def matches(self) -> bool:
        if self.error is not None or self.max_abs is None or self.relative is None:
            return False
        within = self.max_abs <= self.allowed if self.allowed is not None else self.relative <= TOLERANCE
        # no floor could be measured (plain generate cannot prefill this family in chunks on this version): a
        # canonical row is judged by its bitwise equality with the cold run, as the report says
        within = within or (self.bitwise is True and not self.facts.get("floor_measured", True))
        # where plain transformers' own tokens disagree with themselves, tokens are judged only bitwise (if the
        # row is on the canonical schedule) and otherwise through the first-step logits
        tokens = self.greedy_agree == self.greedy_total or not self.tokens_required
        return within and tokens and self.bitwise is not False

    @property
    def verdict(self) -> str:
        if self.group == "kvstate":
            return "pass" if self.matches else "FAIL"
        return "crashes" if self.error else ("matches" if self.matches else "drifts")


@dataclass(frozen=True)
class Floor:
    """Plain transformers against itself: the same history prefilled whole and split at ``splits``
    (first-step max |Δlogit| and greedy agreement, the worst split), and the canonical chunk the
    kvstate rows ran with."""

    max_abs: float
    relative: float
    greedy_agree: int
    greedy_total: int
    splits: list[int]
    chunk: int

    def allowed(self, scale: float) -> float:
        """The max |Δlogit| a kvstate row may show: the floor, and at least fp32's rule."""
        return max(self.max_abs, TOLERANCE * scale)


@dataclass(frozen=True)
class Determinism:
    """The kvstate cold run twice in one process: whether every step's logits and the tokens were bitwise equal,
    the largest |Δlogit| over the steps, and the attention path that ran (``kvstate._compat.attention``). Without
    it nothing else can be bitwise, so ``verify`` measures it first."""

    repeat_bitwise: bool
    max_abs: float
    attention: str


@dataclass(frozen=True)
class Finding:
    """One diagnosis: which branch of the long seed's decision tree, and what to check next."""

    subject: str  # "kvstate" or "plain transformers"
    branch: str
    message: str
    next_check: str


@dataclass
class Report:
    """Every row for one model and backend; ``ok`` is False when any kvstate row failed."""

    model: str
    backend: str
    prompt_tokens: int
    new_tokens: int
    rows: list[Row] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=lambda: environment())
    dtype: str | None = None  # the model's, e.g. "bfloat16"
    device: str | None = None
    floor: Floor | None = None
    determinism: Determinism | None = None

    @property
    def ok(self) -> bool:
        repeats = self.determinism is None or self.determinism.repeat_bitwise
        return repeats and all(row.matches for row in self.rows if row.group == "kvstate")

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "model": self.model, "backend": self.backend,
                "dtype": self.dtype, "device": self.device,
                "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "tolerance": TOLERANCE,
                "floor": None if self.floor is None else asdict(self.floor),
                "determinism": None if self.determinism is None else asdict(self.determinism),
                "ok": self.ok, "rows": [{**asdict(r), "verdict": r.verdict} for r in self.rows],
                "diagnosis": [asdict(f) for f in self.findings], "skipped": self.skipped,
                "environment": self.environment}

    def table(self, colour: bool = False) -> str:
        head = f"{'group':<8} {'check':<46} {'max|Δlogit|':>11} {'cosine':>8} {'top5':>4} {'greedy':>7}  verdict"
        where = "" if self.dtype is None else f", {self.dtype} on {self.device}"
        lines = [f"kvstate verify: {self.model} ({self.backend}{where}), prompt {self.prompt_tokens} tokens, "
                 f"{self.new_tokens} new", _environment_line(self.environment),
                 *_determinism_lines(self.determinism), *_floor_lines(self.floor),
                 head, "-" * len(head)]
        for r in self.rows:
            verdict = _paint(r.verdict, _COLOURS[r.verdict], colour)
            if r.error is not None:
                lines.append(f"{r.group:<8} {r.name:<46} {'error: ' + r.error[:40]:<33}  {verdict}")
            else:
                mark = {True: "=", False: "≠", None: " "}[r.bitwise]
                lines.append(f"{r.group:<8} {r.name:<46} {r.max_abs:>11.3e} {r.cosine:>8.5f} {r.top5_overlap:>4} "
                             f"{r.greedy_agree:>3}/{r.greedy_total:<3} {mark} {verdict}")
        lines += [f"skipped: {s}" for s in self.skipped]
        lines.append("")
        lines += [f"[{f.subject}] {f.branch}: {f.message}\n    next: {f.next_check}" for f in self.findings]
        lines.append("all kvstate paths match the fresh run" if self.ok else
                     "MISMATCH: a kvstate path differs from the fresh run")
        return "\n".join(lines)

    def floor_row(self) -> str:
        """The floor as one Markdown sentence."""
        f = self.floor
        if f is None:
            return ""
        return (f"Noise floor (plain transformers, the same history prefilled whole vs split at {f.splits}): "
                f"max \\|Δ\\| {f.max_abs:.3e} ({f.relative:.1e} relative), greedy {f.greedy_agree}/{f.greedy_total}; "
                f"kvstate rows ran the canonical schedule with chunks of {f.chunk} and must be bitwise equal to "
                "the kvstate cold run (=) and within the floor.")

    def markdown(self) -> str:
        lines = [f"### kvstate verify: `{self.model}` ({self.backend})", "", _environment_line(self.environment), "",
                 f"Prompt {self.prompt_tokens} tokens, {self.new_tokens} greedy tokens; tolerance "
                 f"max \\|Δ\\| ≤ max(noise floor, {TOLERANCE:g} × max \\|reference logit\\|).", "",
                 self.floor_row(), "",
                 "| group | check | max \\|Δlogit\\| | cosine | top-1 | top-5 | greedy | verdict |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in self.rows:
            if r.error is not None:
                lines.append(f"| {r.group} | {r.name} | error: `{r.error[:60]}` | | | | | **{r.verdict}** |")
            else:
                lines.append(f"| {r.group} | {r.name} | {r.max_abs:.3e} | {r.cosine:.5f} | {r.top1} | "
                             f"{r.top5_overlap}/5 | {r.greedy_agree}/{r.greedy_total} | **{r.verdict}** |")
        lines += ["", *[f"- **{f.subject}: {f.branch}.** {f.message} Next: {f.next_check}" for f in self.findings]]
        return "\n".join(lines) + "\n"


_COLOURS = {"pass": "32", "matches": "32", "FAIL": "31", "drifts": "33", "crashes": "33"}


def _paint(text: str, code: str, colour: bool) -> str:
    return f"\033[{code}m{text}\033[0m" if colour else text


def _determinism_lines(d: Determinism | None) -> list[str]:
    if d is None:
        return []
    verdict = "bitwise equal" if d.repeat_bitwise else f"DIFFER (max|Δlogit| {d.max_abs:.3e} over the steps)"
    return [f"determinism: the kvstate cold run twice in this process: {verdict}; attention: {d.attention}"]


def _floor_lines(floor: Floor | None) -> list[str]:
    if floor is None:
        return []
    schedule = (f"canonical chunk {floor.chunk} (=: bitwise the kvstate cold run)" if floor.chunk else
                "no canonical schedule: this family feeds one token per forward (within the floor only)")
    if not floor.splits:
        return ["noise floor: not measured (plain generate cannot prefill this history in chunks here); "
                f"canonical rows are judged bitwise against the kvstate cold run, others by {TOLERANCE:g} x scale; "
                + schedule]
    return [f"noise floor: plain transformers, the same history whole vs split at {floor.splits}: max|Δlogit| "
            f"{floor.max_abs:.3e}, greedy {floor.greedy_agree}/{floor.greedy_total}; {schedule}"]


def compare(name: str, group: str, description: str, logits: torch.Tensor, tokens: torch.Tensor,
            ref_logits: torch.Tensor, ref_tokens: torch.Tensor, facts: dict[str, Any] | None = None, *,
            cold: tuple[torch.Tensor, torch.Tensor] | None = None, floor: Floor | None = None) -> Row:
    """Metrics of one path's first-step logits ``[B, V]`` and tokens ``[B, N]``; ``cold`` is the kvstate
    cold run's ``(logits, tokens)`` when the path must equal it bitwise; ``floor`` sets what is allowed."""
    a, b = logits.float(), ref_logits.float()
    max_abs = (a - b).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()
    top5 = min(len(set(x.tolist()) & set(y.tolist()))
               for x, y in zip(a.topk(5).indices, b.topk(5).indices, strict=True))
    n = min(tokens.shape[1], ref_tokens.shape[1])
    agree = int((tokens[:, :n] == ref_tokens[:, :n]).all(0).int().cumprod(0).sum())
    scale = max(b.abs().max().item(), 1e-30)
    if floor is not None and not floor.splits:
        facts = {**(facts or {}), "floor_measured": False}
    bitwise = None if cold is None else bool(torch.equal(logits, cold[0]) and torch.equal(tokens, cold[1]))
    return Row(name, group, description, max_abs, max_abs / scale, cosine,
               bool((a.argmax(-1) == b.argmax(-1)).all()), top5, agree, ref_tokens.shape[1], facts=facts or {},
               bitwise=bitwise, allowed=None if floor is None else floor.allowed(scale),
               tokens_required=floor is None or (bool(floor.splits) and floor.greedy_agree == floor.greedy_total))


def crashed(name: str, group: str, description: str, exc: BaseException, facts: dict[str, Any] | None = None) -> Row:
    return Row(name, group, description, error=f"{type(exc).__name__}: {exc}"[:300], facts=facts or {})


def environment() -> dict[str, Any]:
    """The versions this run used, and whether transformers is inside kvstate's tested window."""
    import torch

    from .._compat import versions

    return {"transformers": versions.installed(), "torch": torch.__version__, "tested_window": versions.window(),
            "in_window": versions.in_window(versions.installed())}


def _environment_line(env: dict[str, Any]) -> str:
    inside = "inside" if env["in_window"] else "OUTSIDE (untested: results may not hold)"
    return (f"transformers {env['transformers']}, torch {env['torch']}: {inside} the tested window "
            f"{env['tested_window']}")
