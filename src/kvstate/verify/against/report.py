"""Verdicts of ``verify --against`` and their renderings: a terminal table, Markdown and JSON.

``judge`` compares one probe's warm reply with its cold one: greedy text first, then,
where both carry logprobs, the chosen tokens and the largest logprob difference over
the tokens both share (the drift), allowed up to the floor (cold repeats against each
other) or the tolerance, whichever is larger. Verdicts: ``pass`` (a hit was reported and
the answers agree), ``fail`` (they diverge), ``inconclusive`` (no hit reported, the
reference was not cold, the cold repeats disagree among themselves, or a request
failed). A scenario fails if any probe fails and passes if a probe hit and agreed.
JSON follows ``docs/against.schema.json``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .client import Reply
from .scenarios import Probe

SCHEMA_VERSION = 1
# a reference may share a chat template's opening with earlier requests (a radix cache hits a few tokens)
TEMPLATE_SLACK = 32
EXIT = {"consistent": 0, "divergence": 1, "inconclusive": 3}


@dataclass(frozen=True)
class Floor:
    """Cold against cold: the same request sent ``samples`` times to the reference."""

    samples: int = 0
    drift: float | None = None  # largest logprob difference among them (None: no logprobs)
    stable: bool = True  # their texts all agree

    @classmethod
    def measure(cls, replies: list[Reply]) -> Floor:
        ok = [r for r in replies if r.error is None]
        drifts = [_drift(ok[0], r)[1] for r in ok[1:]]
        known = [d for d in drifts if d is not None]
        return cls(len(ok), max(known) if known else None, all(r.text == ok[0].text for r in ok))

    def text(self) -> str:
        if not self.samples:
            return "not measured"
        drift = "" if self.drift is None else f", max logprob drift {self.drift:.3g}"
        return f"{self.samples} cold sends of one request: texts {'agree' if self.stable else 'DIFFER'}{drift}"


@dataclass(frozen=True)
class ProbeResult:
    name: str
    verdict: str  # pass, fail, inconclusive
    note: str = ""
    full: bool = False
    control: bool = False
    position: str = ""
    hit: int | None = None  # cached tokens the warm reply reported (None: no such field)
    prompt_tokens: int | None = None
    cold_hit: int | None = None
    agree: bool | None = None
    first_divergence: int | None = None  # character of the answer where warm and cold part
    token_divergence: int | None = None
    drift: float | None = None
    warm_text: str = ""
    cold_text: str = ""


def judge(probe: Probe, cold: Reply, warm: Reply, floor: Floor, tolerance: float, *, full: bool) -> ProbeResult:
    """The verdict on one probe (see the module docstring)."""
    base = dict(name=probe.name, full=full, control=probe.control, position=probe.position, hit=warm.cached,
                prompt_tokens=warm.prompt_tokens, cold_hit=cold.cached, warm_text=warm.text[:300],
                cold_text=cold.text[:300])
    control = probe.control and not warm.hit  # a control that hit something (a template's opening) is a probe
    base["control"] = control
    if warm.error or cold.error:
        return ProbeResult(verdict="inconclusive", note=f"request failed: {warm.error or cold.error}", **base)
    char = _first_difference(warm.text, cold.text)
    token, drift = _drift(cold, warm)
    allowed = max(floor.drift or 0.0, tolerance)
    drifts = drift is not None and drift > allowed
    diverged = char is not None or token is not None or drifts
    facts = dict(agree=not diverged, first_divergence=char, token_divergence=token, drift=drift, **base)
    if (cold.cached or 0) > TEMPLATE_SLACK and not control:
        return ProbeResult(verdict="inconclusive", note=f"the reference reported {cold.cached} cached tokens: "
                           "it was not cold", **facts)
    if diverged and not floor.stable:
        return ProbeResult(verdict="inconclusive", note="diverges, but so do cold repeats (the floor)", **facts)
    if diverged:
        why = f"logprob drift {drift:.3g} > allowed {allowed:.3g}" if char is None and token is None else \
            f"answers part at character {char}" if token is None else f"answers part at token {token}"
        if control:
            why += "; no cache hit was involved: the two servers differ on their own"
        elif not warm.hit:
            why += "; the server reported no hit"
        return ProbeResult(verdict="fail", note=why, **facts)
    if control:
        return ProbeResult(verdict="pass", note="nothing to hit: the servers agree without a cache", **facts)
    if not warm.hit:
        return ProbeResult(verdict="inconclusive", note="agrees, but no hit was reported" if warm.cached == 0
                           else "agrees, but the server reports no cached-token field", **facts)
    return ProbeResult(verdict="pass", **facts)


def _first_difference(a: str, b: str) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _drift(cold: Reply, warm: Reply) -> tuple[int | None, float | None]:
    """First token where the chosen tokens part, and the largest logprob difference before it."""
    if cold.tokens is None or warm.tokens is None or cold.logprobs is None or warm.logprobs is None:
        return None, None
    pairs = list(zip(cold.tokens, warm.tokens, strict=False))
    token = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
    if token is None and len(cold.tokens) != len(warm.tokens):
        token = len(pairs)
    shared = len(pairs) if token is None else token
    drift = max((abs(a - b) for a, b in zip(cold.logprobs[:shared], warm.logprobs[:shared], strict=False)), default=0.0)
    return token, drift


@dataclass(frozen=True)
class ScenarioResult:
    name: str
    title: str
    probes: list[ProbeResult] = field(default_factory=list)
    skipped: str | None = None  # why it did not run (not counted against the server)
    cut: str | None = None  # a bound stopped it: inconclusive

    @property
    def scored(self) -> list[ProbeResult]:
        return [p for p in self.probes if not p.control]

    @property
    def verdict(self) -> str:
        if self.skipped is not None:
            return "skipped"
        if any(p.verdict == "fail" for p in self.probes):
            return "fail"
        if self.cut is None and any(p.verdict == "pass" for p in self.scored):
            return "pass"
        return "inconclusive"

    @property
    def hits(self) -> int:
        return sum(1 for p in self.scored if p.hit)

    @property
    def reused(self) -> int:
        return sum(p.hit or 0 for p in self.scored)

    @property
    def agreeing(self) -> int:
        return sum(1 for p in self.probes if p.agree)

    def first_divergence(self) -> str:
        failing = next((p for p in self.probes if p.verdict == "fail"), None)
        if failing is None:
            return "-"
        where = f"token {failing.token_divergence}" if failing.token_divergence is not None else \
            f"char {failing.first_divergence}" if failing.first_divergence is not None else f"drift {failing.drift:.3g}"
        return f"{failing.name}: {where}"


@dataclass(frozen=True)
class Finding:
    """One branch of the diagnosis: what the pattern of failures points to and the next check."""

    branch: str
    evidence: str
    next_check: str


@dataclass(frozen=True)
class Report:
    url: str
    cold: str
    mode: str
    model: str
    logprobs: bool
    floor: Floor
    tolerance: float
    requests: int
    seconds: float
    scenarios: list[ScenarioResult]
    findings: list[Finding]
    calibration: str = ""

    @property
    def outcome(self) -> str:
        verdicts = [s.verdict for s in self.scenarios]
        if "fail" in verdicts:
            return "divergence"
        if "inconclusive" in verdicts or "pass" not in verdicts:
            return "inconclusive"
        return "consistent"

    @property
    def exit_code(self) -> int:
        return EXIT[self.outcome]

    def _head(self) -> list[str]:
        logprobs = f"on, tolerance {self.tolerance:g}" if self.logprobs else "off (the servers return none): text only"
        return [f"kvstate verify --against {self.url}: model {self.model}",
                f"cold reference: {self.cold}",
                f"floor: {self.floor.text()}; logprobs {logprobs}",
                f"divergence positions: {self.calibration}",
                f"{self.requests} requests in {self.seconds:.1f}s"]

    def _rows(self) -> list[tuple[str, ...]]:
        rows = []
        for s in self.scenarios:
            if s.skipped is not None:
                rows.append((s.name, "-", "-", "-", s.skipped[:60], "skipped"))
                continue
            rows.append((s.name, f"{s.hits}/{len(s.scored)}", str(s.reused), f"{s.agreeing}/{len(s.probes)}",
                         s.first_divergence(), s.verdict + (f" ({s.cut})" if s.cut else "")))
        return rows

    def _details(self) -> list[str]:
        lines = []
        for s in self.scenarios:
            for p in s.probes:
                if p.verdict != "pass":
                    where = f" [{p.position}]" if p.position else ""
                    lines.append(f"{s.name} / {p.name}{where}: {p.verdict}: {p.note} (hit {p.hit}, "
                                 f"warm {p.warm_text[:40]!r} vs cold {p.cold_text[:40]!r})")
        return lines

    def table(self) -> str:
        header = ("scenario", "hits", "reused", "agree", "first divergence", "verdict")
        rows = [header, *self._rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = self._head() + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines += self._details()
        lines += [f"[{f.branch}] {f.evidence}\n    next: {f.next_check}" for f in self.findings]
        lines.append(f"outcome: {self.outcome} (exit {self.exit_code})")
        return "\n".join(lines)

    def markdown(self) -> str:
        lines = [f"### Cache hits against cold runs: {self.outcome}", "", *(f"- {h}" for h in self._head()), "",
                 "| scenario | hits | tokens reused | agree | first divergence | verdict |",
                 "|---|---|---|---|---|---|"]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in self._rows()]
        details = self._details()
        if details:
            lines += ["", "<details><summary>probes that did not pass</summary>", "", *(f"- {d}" for d in details),
                      "", "</details>"]
        if self.findings:
            lines += ["", "**Diagnosis**", ""] + [f"- **{f.branch}**: {f.evidence}. Next: {f.next_check}."
                                                  for f in self.findings]
        lines += ["", "Generated by `kvstate verify --against` (docs/against.md)."]
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "url": self.url, "model": self.model, "mode": self.mode,
                "cold_reference": self.cold, "logprobs": self.logprobs, "tolerance": self.tolerance,
                "floor": asdict(self.floor), "calibration": self.calibration, "requests": self.requests,
                "seconds": round(self.seconds, 3), "outcome": self.outcome, "exit_code": self.exit_code,
                "scenarios": [{"name": s.name, "title": s.title, "verdict": s.verdict, "skipped": s.skipped,
                               "cut": s.cut, "hits": s.hits, "probes_scored": len(s.scored),
                               "tokens_reused": s.reused, "probes": [asdict(p) for p in s.probes]}
                              for s in self.scenarios],
                "findings": [asdict(f) for f in self.findings]}
