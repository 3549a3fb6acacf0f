"""The diagnosis of ``verify --against``, in the long seed's style: which probes fail names the fault.

The rules read the pattern of failing probes, most specific first:

| what fails                                        | points to                                  |
|---------------------------------------------------|--------------------------------------------|
| the control probes (nothing to hit)               | the reference is not a twin of the server  |
| only after a restart                              | the persistent tier serves wrong K/V       |
| only under concurrency                            | contamination across requests              |
| only the image scenario                           | media missing from the key                 |
| only the multi-turn chat                          | the template, or a token merged at a turn  |
| only streaming / only the long prompt             | that path / window and block boundaries    |
| only full hits (partial hits pass)                | the token boundary: last token re-fed or dropped |
| every hit, full and partial                       | positions or K/V wrong after any hit       |
| shared prefixes or edited turns, repeats pass     | a stale or colliding key                   |

Each finding names the next check. In first-occurrence mode every warm request is a full
hit, so the full/partial rules cannot separate (the report says so).
"""

from __future__ import annotations

from .report import Finding, ProbeResult, ScenarioResult

NEXT = {
    "twin": ("reference is not a twin", "the servers disagree on requests that involve no cache",
             "run the same engine, model, dtype and flags on both servers, changing only the cache"),
    "restart": ("persistent tier", "only requests served after the restart diverge",
                "compare a block restored from disk or host memory with the same block recomputed (sglang#39830)"),
    "concurrent": ("cross-request contamination", "only requests sent by concurrent clients diverge",
                   "check that a slot, page or buffer belongs to one request at a time and is freed only after it "
                   "ends; rerun with --clients 2 --rounds 4 (LMCache#4385)"),
    "image": ("media missing from the key", "only the same text with a different image diverges",
              "put a full-length content hash of every image into the keys of the blocks that hold its tokens "
              "(LMCache#4086)"),
    "multi-turn": ("chat template or a token merged at the turn boundary", "only the multi-turn chat diverges",
                   "compare turn n+1's rendered tokens with turn n's prompt plus its generated tokens: a template "
                   "that renders the answer differently, or a token merged across the boundary, changes the prefix"),
    "streaming": ("the streaming path", "only streamed requests diverge",
                  "compare the cache lookup and the prompt tokens of the streamed and the whole code paths"),
    "long": ("window and block boundaries", "only the long prompt diverges",
             "check which sliding-window and block boundaries a hit restores; rerun with --long-chars 2000 and "
             "--long-chars 12000"),
    "boundary": ("token boundary: the last token re-fed or dropped", "only full hits (the very prompt cached) "
                 "diverge; partial hits agree",
                 "after a full hit the engine must reuse at most n-1 prompt tokens and feed the last one exactly "
                 "once: log the first forward's input ids and positions (the long seed; vllm#40896)"),
    "positions": ("positions or K/V wrong after any hit", "every request that hit diverges, full and partial "
                  "alike", "compare the positions (RoPE offsets) of the tokens fed after a hit with cached_tokens, "
                  "and a reused block's K/V with the same block recomputed (llama.cpp#28498)"),
    "key": ("stale or colliding key", "requests that leave a cached prefix diverge while identical repeats agree",
            "key every block by the whole token prefix up to it (chained with its parent's hash), plus media and "
            "salt, and compare tokens on a lookup, not a key of the first N tokens (sglang#34683)"),
}
ONLY = ("restart", "concurrent", "image", "multi-turn", "streaming", "long")


def diagnose(scenarios: list[ScenarioResult], mode: str = "cold-server") -> list[Finding]:
    """Findings for the failing probes (none when nothing fails), then what limits them."""
    findings = _pattern(scenarios)
    failing = [p for s in scenarios for p in s.probes if p.verdict == "fail" and not p.control]
    if failing and all(p.hit is None for p in failing):
        findings.append(Finding("no hit reported", "the server reports no cached-token field, so a divergence "
                                "cannot be tied to a cache hit: it may come from numerics that depend on how much "
                                "of the prompt one forward takes (batch-size dependence), not from a wrong cache",
                                "compare against a --cold twin of the same server, and ask the engine to report "
                                "cached tokens"))
    if failing and mode == "first-occurrence":
        findings.append(Finding("reference is the first occurrence", "every warm request repeated its own first "
                                "send, so full and partial hits cannot be told apart and no floor was measured",
                                "rerun with --cold URL (the same engine with caching off), or enable the engine's "
                                "cache-reset route"))
    return findings


def _pattern(scenarios: list[ScenarioResult]) -> list[Finding]:
    findings = []
    probes = [(s.name, p) for s in scenarios for p in s.probes]
    if any(p.control and p.verdict == "fail" for _, p in probes):
        findings.append(_finding("twin", [(n, p) for n, p in probes if p.control and p.verdict == "fail"]))
    failing = [(n, p) for n, p in probes if not p.control and p.verdict == "fail"]
    if not failing:
        return findings
    failed = {n for n, _ in failing}
    hit_and_agree = [p for _, p in probes if not p.control and p.verdict == "pass"]
    branch = _branch(failed, failing, hit_and_agree)
    if branch is None:
        findings.append(Finding("several kinds of request fail",
                                f"failing scenarios: {', '.join(sorted(failed))}",
                                "run them one at a time with --scenarios NAME to separate the faults"))
    else:
        findings.append(_finding(branch, failing))
    return findings


def _branch(failed: set[str], failing: list[tuple[str, ProbeResult]], passing: list[ProbeResult]) -> str | None:
    if len(failed) == 1 and next(iter(failed)) in ONLY:
        return next(iter(failed))
    if all(p.full for _, p in failing) and any(not p.full for p in passing):
        return "boundary"
    if not any(p.hit for p in passing) and any(p.full for _, p in failing) and any(not p.full for _, p in failing):
        return "positions"
    if failed & {"shared-prefix", "edited-turn"} and "repeat" not in failed:
        return "key"
    return None


def _finding(branch: str, failing: list[tuple[str, ProbeResult]]) -> Finding:
    title, evidence, next_check = NEXT[branch]
    names = ", ".join(f"{n}/{p.name}" for n, p in failing[:6]) + (" ..." if len(failing) > 6 else "")
    return Finding(title, f"{evidence} ({names})", next_check)
