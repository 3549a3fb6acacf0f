"""The long seed's decision tree, applied to a report's rows.

Each rule reads the ``facts`` of failing kvstate rows (or the pattern of the plain
rows) and names the branch in plain words with the next check to run. The tree:
K/V reconstruction -> resume inputs and the full mask -> token boundary ->
model-side state -> logical positions; before all of them, kernels that do not
repeat their bits (two cold runs differ), which makes every other branch moot.
"""

from __future__ import annotations

from .report import Determinism, Finding, Row

BRANCHES = {
    "reconstruction": ("K/V reconstruction",
                       "only rows whose K/V were rebuilt fail, and their K/V differ from the original state's",
                       "compare the rebuilt K/V slot by slot with the original (state.layers) and audit the copy path"),
    "mask": ("resume-input contract (full mask)",
             "the failing continuation ran without an attention mask covering processed + new tokens; "
             "original and rebuilt states behave alike, so this is not reconstruction",
             "pass the full-length attention_mask and check the input_ids shape reaching the first forward"),
    "boundary": ("token boundary",
                 "a token already in the state was fed again (cache(prompt) + prompt[-1]), so it was processed twice",
                 "feed only tokens after state.tokens; Session.generate(full history) does this"),
    "model_side": ("model-side state outside K/V",
                   "the same instance works but a fresh instance fails with identical K/V, mask and positions",
                   "compare model-side values between instances (e.g. Qwen-VL rope_deltas) and restore them"),
    "positions": ("logical positions",
                  "identical K/V with a full mask on the same instance still differ, so new tokens were fed "
                  "at the wrong logical positions",
                  "compare state.next_position and the first forward's position_ids with the reference's"),
    "kernels": ("kernel nondeterminism",
                "two kvstate cold runs on the same history, in the same process, differ: this device's kernels are "
                "not run-to-run deterministic for {attention}, so no warm path can equal a cold run bit for bit, and "
                "the other rows' differences say nothing about positions, masks or the token boundary",
                "load the model with attn_implementation='sdpa' (kvstate runs it through deterministic kernels on "
                "CUDA) or 'eager'; with custom kernels, pass canonical_chunk=0 and judge within the noise floor"),
    "unclassified": ("unclassified", "a kvstate row failed in a way the decision tree does not cover",
                     "rerun with --json and compare the failing rows' facts"),
}


def diagnose(rows: list[Row], determinism: Determinism | None = None) -> list[Finding]:
    """Findings for failing kvstate rows, then what the plain-transformers rows show. Where two cold runs differ
    (``determinism``), that is the one finding: no row's difference can then be told from the kernels' noise."""
    failing = [r for r in rows if r.group == "kvstate" and not r.matches]
    if determinism is not None and not determinism.repeat_bitwise:
        branch, message, next_check = BRANCHES["kernels"]
        detail = (f" (max |Δlogit| {determinism.max_abs:.3e} between the two cold runs; {len(failing)} kvstate rows "
                  "differ)")
        return [Finding("kvstate", branch, message.format(attention=determinism.attention) + detail, next_check)]
    branches: dict[str, list[str]] = {}
    for row in failing:
        branches.setdefault(_branch(row, rows), []).append(row.name)
    findings = [_finding("kvstate", key, names) for key, names in branches.items()]
    return findings + _plain_findings({r.name: r for r in rows if r.group == "plain"})


def _branch(row: Row, rows: list[Row]) -> str:
    facts = row.facts
    if facts.get("kv_identical") is False:
        return "reconstruction"
    if facts.get("full_mask") is False:
        return "mask"
    if facts.get("refed"):
        return "boundary"
    if facts.get("instance") == "fresh":
        twin = next((r for r in rows if r.name == facts.get("twin")), None)
        if twin is not None and not twin.matches:
            return _branch(twin, rows)  # the same-instance twin fails too: not a model-side problem
        return "model_side" if twin is not None else "unclassified"
    if facts.get("instance", "same") == "same" and facts.get("full_mask", True):
        return "positions"
    return "unclassified"


def _finding(subject: str, key: str, names: list[str]) -> Finding:
    branch, message, next_check = BRANCHES[key]
    return Finding(subject, branch, f"{message} (rows: {', '.join(names)})", next_check)


def _plain_findings(plain: dict[str, Row]) -> list[Finding]:
    out = []
    neither, mask_only = plain.get("plain: neither"), plain.get("plain: mask only")
    if neither and mask_only and not neither.matches and mask_only.matches:
        out.append(Finding("plain transformers", "resume-input contract (full mask)",
                           f"without a full-length mask generate() {neither.verdict}; with the mask the same cache "
                           "resumes, so the cache itself is fine",
                           "always pass attention_mask over processed + new tokens (kvstate does)"))
    positions = plain.get("plain: positions only")
    if positions and mask_only and not positions.matches and mask_only.matches:
        out.append(Finding("plain transformers", "resume-input contract (full mask)",
                           "explicit position_ids without the full mask do not help: the unprocessed token is "
                           "sliced away before the model sees it", "pass the full mask, not only positions"))
    refed = plain.get("plain: re-fed last token")
    if refed and not refed.matches:
        out.append(Finding("plain transformers", "token boundary",
                           f"re-feeding the last processed token {refed.verdict}: it is processed twice",
                           "split as cache(prompt[:-1]) + prompt[-1], or let kvstate track the boundary"))
    for name, row in plain.items():
        if "fresh instance" in name and not row.matches and mask_only and mask_only.matches:
            out.append(Finding("plain transformers", "model-side state outside K/V",
                               f"'{name}' {row.verdict} while the same instance matches: state outside the K/V "
                               "did not move with the cache", "carry model-side state with the cache (kvstate does)"))
    return out
