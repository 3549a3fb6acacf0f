"""Merging ``bench/bench_ruler.py``'s runs into one results file: scores, the issue's summary, the plot.

Every answer is scored with RULER's ``string_match_all`` against the task file's references. Of the
contexts asked for, those that every run of a model has covered count (a partial run gives figures on
the contexts done); shares are accuracies over
the same side's uncompressed accuracy. The paired bootstrap resamples questions (10,000 times,
seeded) and gives the 95% interval of the mean per-question difference kvstate-best minus
kvpress-best, at kvpress's share (of the entries kept; kvpress masks and holds every byte) and at that
share of the bytes for kvstate. The cross-check names every question where kvstate, keeping kvpress's very slots,
answers otherwise than kvpress (a resume difference, since the choice was the same).
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from ruler_tasks import TASKS, string_match_all

SIDES = ("kvstate", "kvpress", "keep")


def load_runs(folder: Path, model: str) -> dict[tuple[str, str], dict]:
    """``{(context, run): row}`` of a model's JSON-lines files (a resumed run's later row wins)."""
    rows: dict[tuple[str, str], dict] = {}
    for side in SIDES:
        path = folder / f"{model}.{side}.jsonl"
        if path.is_file():
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    rows[(row["context"], row["run"])] = row
    return rows


def bootstrap(diff: list[float], rounds: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """The 95% percentile interval of the mean of ``diff`` over resampled questions."""
    rng, n = random.Random(seed), len(diff)
    means = sorted(sum(diff[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


def model_result(model: str, contexts: list[dict], rows: dict[tuple[str, str], dict]) -> dict:
    """Scores, accuracies, shares, bytes and timings of every complete run of one model."""
    questions = [(ctx, i, q) for ctx in contexts for i, q in enumerate(ctx["questions"])]
    names = sorted({run for _, run in rows})
    scores, complete = {}, []
    for run in names:
        if all((ctx["id"], run) in rows for ctx in contexts):
            complete.append(run)
            scores[run] = [string_match_all(rows[(ctx["id"], run)]["answers"][i], q["outputs"])
                           for ctx, i, q in questions]
    accuracy = {run: sum(s) / len(s) for run, s in scores.items()}
    by_task = {run: {task: _mean([s for s, (_, _, q) in zip(scores[run], questions, strict=True)
                                  if q["task"] == task]) for task in TASKS} for run in complete}
    facts = {run: {key: _mean([rows[(ctx["id"], run)].get(key) for ctx in contexts])
                   for key in ("bytes_held", "slots_kept", "prefill_cpu", "compress_cpu", "answer_cpu")}
             for run in complete}
    made_by = {side: sorted({json.dumps(row.get("commit") or row.get("env"), sort_keys=True) for (_, run), row
                             in rows.items() if run.split("/")[0] == side}) for side in ("kvstate", "kvpress", "keep")}
    return {"questions": len(questions), "contexts": len(contexts), "complete_runs": complete,
            "made_by": {side: [json.loads(x) for x in made] for side, made in made_by.items() if made},
            "partial_runs": sorted(set(names) - set(complete)), "accuracy": accuracy, "accuracy_by_task": by_task,
            "share_of_uncompressed": {run: _share(accuracy, run) for run in complete}, "facts": facts,
            "per_question": {"ids": [f"{ctx['id']}#{i}" for ctx, i, _ in questions],
                             "tasks": [q["task"] for _, _, q in questions], "scores": scores},
            "seconds": timings(contexts, rows, complete, len(questions))}


def _mean(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _share(accuracy: dict[str, float], run: str) -> float | None:
    """``run``'s accuracy over its own side's uncompressed accuracy (kvpress's for kvpress runs)."""
    base = accuracy.get("kvpress/none/1" if run.startswith("kvpress/") else "kvstate/none/1")
    return accuracy[run] / base if base else None


def timings(contexts: list[dict], rows: dict[tuple[str, str], dict], complete: list[str], questions: int) -> dict:
    """CPU seconds (this process's, which the machine's other load inflates less than wall time) per context
    prefilled, per answer, and per question over all of a side's runs; wall seconds beside them."""
    out: dict[str, object] = {}
    for side in ("kvstate", "kvpress"):
        runs = [r for r in complete if r.split("/")[0] in ((side, "aware") if side == "kvstate" else (side,))]
        if not runs:
            continue
        cells = [rows[(c["id"], r)] for c in contexts for r in runs]
        totals = {}
        for clock in ("cpu", "s"):
            prefills = [rows[(c["id"], runs[0])][f"prefill_{clock}"] for c in contexts]
            # kvstate prefills once per context and compresses per run; kvpress prefills again for every run
            work = sum(prefills) + sum(cell.get(f"compress_{clock}", 0.0) for cell in cells) if side == "kvstate" \
                else sum(cell[f"prefill_{clock}"] for cell in cells)
            answer = sum(cell[f"answer_{clock}"] for cell in cells)
            totals[clock] = {"prefill_per_context": statistics.median(prefills),
                             "answer_per_question_per_run": answer / (questions * len(runs)),
                             "total": work + answer, "per_question_all_runs": (work + answer) / questions}
        out[side] = {"runs": len(runs), "cpu": totals["cpu"], "wall": totals["s"]}
    kvzip = [rows[(c["id"], "kvstate/KVzip/0.5")] for c in contexts if (c["id"], "kvstate/KVzip/0.5") in rows]
    plain = [r["compress_cpu"] / r["plain_prefill_cpu"] for r in kvzip if r.get("plain_prefill_cpu")]
    chunked = [r["compress_cpu"] / r["prefill_cpu"] for r in kvzip]
    # CPU seconds in the same process: over one plain transformers forward of the context (the fair
    # baseline), and over kvstate's own prefill (its canonical chunks)
    out["kvzip_cost_vs_prefill"] = statistics.median(plain) if plain else None
    out["kvzip_cost_vs_kvstate_prefill"] = statistics.median(chunked) if chunked else None
    out["kvzip_cost_contexts"] = len(plain)
    # the scoring grows with the square of the length, a prefill of a small model nearly linearly
    lengths = sorted({c["id"].split("/")[0] for c in contexts})
    by_length = {n: [r["compress_cpu"] / r["plain_prefill_cpu"] for c in contexts if c["id"].startswith(n + "/")
                     and (r := rows.get((c["id"], "kvstate/KVzip/0.5"))) and r.get("plain_prefill_cpu")]
                 for n in lengths}
    out["kvzip_cost_vs_prefill_by_length"] = {n: statistics.median(v) for n, v in by_length.items() if v}
    return out


BYTES_SLACK = 0.01  # a run "at 50%" may hold up to 51% of the bytes (rounding to whole slots per head)


def best(result: dict, side: str, share: str, entries: bool = False) -> str | None:
    """The run of ``side`` with the highest accuracy at ``share`` kept (None if there is none). kvstate's
    share is of the entries the layers read and of the bytes: a run that keeps ``share`` of the entries but
    pads to more bytes is not at ``share``. One that keeps more of the entries is not either, even where its
    bytes fit: on Gemma 3 the uncompressed state holds each sliding layer's rollback reserve beyond its
    window (58% of the entries is 50% of those bytes), which a plain transformers cache does not hold, so
    the entries are what ``share`` of a plain cache's bytes holds. kvpress's share is its
    ``compression_ratio``'s (AdaKV and KVzip mask evicted keys and hold them), and so is kvstate's with
    ``entries``: kept entries, whatever bytes their padding holds."""
    def at(run: str) -> bool:
        if not run.endswith(f"/{share}"):
            return False
        held = result["facts"].get(run, {}).get("bytes_held")
        return side != "kvstate" or entries or held is None or held <= float(share) + BYTES_SLACK

    runs = [r for r in result["accuracy"] if r.startswith(f"{side}/") and "/none/" not in r and at(r)]
    return max(runs, key=lambda r: (result["accuracy"][r], r)) if runs else None


def versus(result: dict, share: str, entries: bool = True) -> dict | None:
    """kvstate's best against kvpress's best at one share: accuracies and the paired bootstrap interval. The
    share is kvpress's (of the entries kept) on both sides; ``entries=False``: kvstate's at that share of the
    bytes, against kvpress's holding every byte."""
    ours, theirs = best(result, "kvstate", share, entries), best(result, "kvpress", share)
    return None if ours is None or theirs is None else paired(result, ours, theirs)


def paired(result: dict, ours: str, theirs: str) -> dict:
    """Run ``ours`` against run ``theirs`` on the same questions: accuracies, the mean per-question
    difference and its paired bootstrap 95% interval."""
    s = result["per_question"]["scores"]
    diff = [a - b for a, b in zip(s[ours], s[theirs], strict=True)]
    low, high = bootstrap(diff)
    return {"kvstate": ours, "kvpress": theirs, "kvstate_accuracy": result["accuracy"][ours],
            "kvpress_accuracy": result["accuracy"][theirs], "mean_difference": sum(diff) / len(diff),
            "ci95": [low, high]}


def cross_check(rows: dict[tuple[str, str], dict], contexts: list[dict]) -> dict:
    """Answers of kvstate keeping kvpress's slots against kvpress's own; and uncompressed against uncompressed."""
    out: dict[str, object] = {}
    kept = sorted({(run, "kvpress/" + run.split("/", 1)[1]) for _, run in rows if run.startswith("keep/")})
    pairs = [("kvstate/none/1", "kvpress/none/1"), *kept]
    for mine, theirs in pairs:
        differ, total = [], 0
        for ctx in contexts:
            a, b = rows.get((ctx["id"], mine)), rows.get((ctx["id"], theirs))
            if a is None or b is None:
                continue
            for i, (x, y) in enumerate(zip(a["answers"], b["answers"], strict=True)):
                total += 1
                if x.strip() != y.strip():
                    differ.append({"question": f"{ctx['id']}#{i}", "kvstate": x, "kvpress": y})
        if total:
            out[mine] = {"against": theirs, "questions": total, "same_answer": total - len(differ),
                         "resume_differences": differ, "accuracy": _accuracies(
                             rows, contexts, [mine, theirs, "kvstate/" + mine.split("/", 1)[1]])}
    return out


def _accuracies(rows: dict[tuple[str, str], dict], contexts: list[dict], runs: list[str]) -> dict[str, float]:
    """Each run's accuracy on the contexts all of ``runs`` cover (the cross-check's subset): kvstate keeping
    kvpress's slots, kvpress itself, and kvstate's own policy of that name, on identical questions."""
    both = [c for c in contexts if all((c["id"], r) in rows for r in runs)]
    out = {}
    for run in runs:
        scores = [string_match_all(rows[(c["id"], run)]["answers"][i], q["outputs"]) for c in both
                  for i, q in enumerate(c["questions"])]
        if scores:
            out[run] = sum(scores) / len(scores)
    return out


def summary(results: dict[str, dict]) -> dict:
    """The issue's summary: per model, the uncompressed accuracy, the best question-agnostic policy at 50%,
    kvpress's best there, the bootstrap's lower bound, question-aware SnapKV at 25%; KVzip's cost."""
    out: dict[str, object] = {}
    for model, r in results.items():
        top = best(r, "kvstate", "0.5")
        press = best(r, "kvpress", "0.5")
        vs, vs_bytes = versus(r, "0.5"), versus(r, "0.5", entries=False)
        out[model] = {
            "questions": r["questions"], "uncompressed": r["accuracy"].get("kvstate/none/1"),
            "best_agnostic_at_50": None if top is None else {
                "policy": top.split("/")[1], "share_of_uncompressed": r["share_of_uncompressed"][top],
                "bytes_held": r["facts"][top]["bytes_held"], "entries_kept": float(top.rsplit("/", 1)[1])},
            "kvpress_best_at_50": None if press is None else {
                "press": press.split("/")[1], "share_of_uncompressed": r["share_of_uncompressed"][press]},
            "paired_ci_low_vs_kvpress": None if vs is None else vs["ci95"][0],
            "vs_kvpress_at_50": None if vs is None else {
                "kvstate": vs["kvstate"], "bytes_held": r["facts"][vs["kvstate"]]["bytes_held"],
                "mean_difference": vs["mean_difference"], "ci95": vs["ci95"]},
            "vs_kvpress_at_50_of_the_bytes": None if vs_bytes is None else {
                "kvstate": vs_bytes["kvstate"], "mean_difference": vs_bytes["mean_difference"],
                "ci95": vs_bytes["ci95"]},
            "vs_kvpress_every_share": _every_share(r),
            **_aware(r),
        }
    costs = [r["seconds"]["kvzip_cost_vs_prefill"] for r in results.values() if r["seconds"]["kvzip_cost_vs_prefill"]]
    out["kvzip_cost_vs_prefill"] = max(costs) if costs else None  # the worse model's median
    return out


SAME_CHOICE = "kvstate/KVzipEvictEntries"  # kvpress's KVzipPress's very entries (bench/kvzip_overlap.py)


def _every_share(r: dict) -> dict[str, dict]:
    """kvstate's best against kvpress's best at each share both sides ran (of the entries kept, kvpress's
    meaning), on the most questions that cover both: the summary's figures, else ``every_run``'s; beside it,
    kvstate keeping kvpress's KVzip choice (``same_choice``) against that press."""
    out = {}
    for scored in (r, r.get("every_run") or {}):
        for share, vs in (scored.get("vs_kvpress_by_share") or {}).items():
            if vs is None or share in out:
                continue
            out[share] = {**vs, "questions": scored["questions"],
                          "kvstate_bytes_held": scored["facts"][vs["kvstate"]]["bytes_held"]}
            same, press = f"{SAME_CHOICE}/{share}", f"kvpress/KVzip/{share}"
            if same in scored["accuracy"] and press in scored["accuracy"]:
                out[share]["same_choice"] = {**paired(scored, same, press),
                                             "bytes_held": scored["facts"][same]["bytes_held"]}
    return dict(sorted(out.items(), key=lambda item: float(item[0])))


def _aware(r: dict) -> dict[str, object]:
    """The best question-aware run at 25% kept: its share of the uncompressed accuracy, its policy and the
    questions it was measured on (those every run covered, when the question-aware runs covered fewer)."""
    for scored in (r, r.get("every_run") or {}):
        runs = {k: v for k, v in scored.get("share_of_uncompressed", {}).items()
                if k.startswith("aware/") and k.endswith("/0.25")}
        top = max(runs, key=lambda k: (runs[k], k), default=None)
        if top is not None:
            return {"aware_at_25": runs[top], "aware_at_25_policy": top.split("/")[1],
                    "aware_at_25_questions": scored["questions"]}
    return {"aware_at_25": None, "aware_at_25_policy": None}


def merge(tasks: dict, contexts: list[dict], folder: Path, models: list[str]) -> dict:
    """The whole results file (less the environment, which ``write_results`` adds)."""
    results, checks = {}, {}
    for model in models:
        rows = load_runs(folder, model)
        asked = {c["id"] for c in contexts}
        # the figures count the contexts that the wide runs (over at least half as many contexts as the widest)
        # all covered; the narrower runs are scored again, with every run, on the contexts all of them covered
        # ("every_run"). The cross-check's keep runs, on a subset, are compared where they exist and narrow neither
        runs = {run for ctx, run in rows if ctx in asked and not run.startswith("keep/")}
        cover = {run: sum((c["id"], run) in rows for c in contexts) for run in runs}
        widest = [run for run in runs if 2 * cover[run] >= max(cover.values())]
        done = [c for c in contexts if all((c["id"], run) in rows for run in widest)]
        every = [c for c in contexts if all((c["id"], run) in rows for run in runs)]
        results[model] = _scored(model, done, rows)
        if len(every) < len(done):
            results[model]["every_run"] = _scored(model, every, rows)
        checks[model] = cross_check(rows, done)
    return {"summary": summary(results), "suite": {"task_file": "bench/data/ruler_tasks.json", "seed": tasks["seed"],
                                                   "sources": tasks["sources"], "contexts": len(contexts),
                                                   "kvpress_models": "smollm2 only: kvpress 0.5.5's KVzipPress "
                                                   "refuses Gemma3ForCausalLM"},
            "models": results, "cross_check": checks}


def _scored(model: str, contexts: list[dict], rows: dict[tuple[str, str], dict]) -> dict:
    result = model_result(model, contexts, rows)
    shares = sorted({r.rsplit("/", 1)[1] for r in result["accuracy"] if "/none/" not in r})
    result["vs_kvpress_by_share"] = {s: versus(result, s) for s in shares}
    result["vs_kvpress_by_share_of_the_bytes"] = {s: versus(result, s, entries=False) for s in shares}
    return result


def table(result: dict) -> str:
    """A Markdown table per model: accuracy (share of uncompressed) per method and share kept, bytes held at 50%."""
    out = []
    for model, r in result["models"].items():
        acc, share = r["accuracy"], r["share_of_uncompressed"]
        shares = sorted({run.rsplit("/", 1)[1] for run in acc if "/none/" not in run}, key=float)
        out += [f"**{model}** ({r['questions']} questions, {r['contexts']} contexts): uncompressed "
                f"{acc.get('kvstate/none/1', float('nan')):.1%} (kvstate)" +
                (f", {acc['kvpress/none/1']:.1%} (kvpress)" if "kvpress/none/1" in acc else ""), "",
                "| method | " + " | ".join(f"{float(s):.0%} kept" for s in shares) + " | bytes held at 50% |",
                "|---|" + "---|" * (len(shares) + 1)]
        for method in sorted({run.rsplit("/", 1)[0] for run in acc if "/none/" not in run}):
            cells = [f"{acc[f'{method}/{s}']:.1%} ({share[f'{method}/{s}']:.0%})" if f"{method}/{s}" in acc else ""
                     for s in shares]
            held = r["facts"].get(f"{method}/0.5", {}).get("bytes_held")
            out.append(f"| {method} | " + " | ".join(cells) + f" | {'' if held is None else f'{held:.0%}'} |")
        out.append("")
    return "\n".join(out)


def plot(result: dict, path: Path) -> None:
    """Accuracy against the share of K/V kept, one panel per model, one line per policy or press."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # each model's widest runs, then (where narrower runs exist) every run on the questions they all covered
    panels = [(model, scored) for model, r in result["models"].items()
              for scored in (r, r.get("every_run")) if scored and scored.get("accuracy")]
    cols = min(len(panels), 2)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 5.2 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (model, scored) in zip(axes.flat, panels, strict=False):  # the spare panels stay hidden
        acc = scored["accuracy"]
        methods = sorted({tuple(r.split("/")[:2]) for r in acc if "/none/" not in r and not r.startswith("aware")})
        color = {name: f"C{i % 10}" for i, name in enumerate(sorted({name for _, name in methods}))}
        for side, name in methods:
            points = sorted((float(r.split("/")[2]) * 100, a) for r, a in acc.items()
                            if r.startswith(f"{side}/{name}/"))
            base = acc.get(f"{'kvpress' if side == 'kvpress' else 'kvstate'}/none/1")
            if base is not None:
                points.append((100.0, base))
            style = {"kvstate": "o-", "kvpress": "s--", "keep": "x:"}[side]
            ax.plot(*zip(*points, strict=True), style, color=color[name], label=f"{name} ({side})")
        for i, run in enumerate(sorted(r for r in acc if r.startswith("aware/"))):
            ax.plot([float(run.split("/")[2]) * 100], [acc[run]], "*", color=("k", "r", "g", "m")[i % 4],
                    markersize=12, label=f"{run.split('/')[1]}, question-aware")
        ax.set(xlabel="share of the context's K/V kept (%)", ylabel="RULER string-match accuracy",
               title=f"{model}: {scored['questions']} questions", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
