"""Raw prompts turn by turn: `kvstate serve` against `--canonical-chunk 0` and `transformers serve`, one run.

The conversation of a raw Q&A client over ``/v1/completions`` (no chat template), on the default model
(Gemma-3-270M, float32), through the official ``openai`` client, greedy and streamed: a 3,000-character document
of 30 lines, then 10 turns of ``Q: ...\nA:``, each answered with 16 tokens (no stop string); the client keeps one
prompt and appends each answer and the next question. Three runs:

* **raw-agent**: the next request as soon as the answer arrives (an agent);
* **raw-paused**: 1 s between an answer and the next request (a user reading; kvstate servers only: a server
  without a prompt cache does the same work either way);
* **raw-shared**: 10 new conversations on the same document, one question each (``doc + Q: ...\nA:``), sent one
  after another: a prompt that shares only the document with the pooled states.

Servers, each in its own process with the same threads, one at a time (the others idle), in an order rotated
every round, each run in a fresh API key's namespace:

* ``default``: `kvstate serve` as shipped (the canonical schedule, C = 256 on a CPU; raw prompts cut with prompt
  marks: after the prompt's last-line label, at lines C/4 apart);
* ``off``: ``--canonical-chunk 0``: no schedule; a turn feeds only its new tokens (exact to float32 rounding only,
  not bitwise: the one-forward limit);
* ``transformers``: ``transformers serve`` of the installed transformers on the same weights (no prompt cache:
  every turn prefills the whole history, in one forward);
* ``before`` (with ``--before REV``): `kvstate serve` of commit REV, from a ``git archive`` of it (raw prompts cut
  at every line there).

Per turn it records the time to the first text (TTFT), to the end, ``cached_tokens``, and for kvstate servers the
model forwards the request ran (``serve_counted.py`` logs each forward; the prompt's forwards are those less one
per generated token but the first: the rest decode). The summary takes each turn's median over the rounds and the
ratios the goals name: cold TTFT against ``off``, each warm turn against ``off``, turn 10 against ``transformers``.

    python bench/bench_serve_reuse.py --before 0055466   # about 25 minutes on 2 idle cores (serve_reuse.json)

On a machine shared with other work, ``--threads 1``: two OpenMP threads per server spin at every operation's
barrier while the other thread waits for a core, which makes a forward's fixed cost, not its tokens, decide.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results

PARAGRAPHS = "\n".join([
    "The Harbour Town of Lindqvist: A Short Guide",
    "Lindqvist is a small harbour town on the western coast, founded in 1612 by fishermen who came from the "
    "northern islands. For two centuries its economy rested on herring, and the old smokehouses along the quay "
    "still stand, although most of them now hold cafes, a bookshop and a small museum of fishing boats.",
    "The town has about nine thousand inhabitants. Its mayor is elected every four years; the current mayor, "
    "Ingrid Solberg, took office in 2021 and is the first mayor who was born on one of the outer islands. The "
    "town council meets on the first Monday of each month in the old customs house.",
    "The lighthouse on Gull Point was built in 1874 and is 31 metres tall. It was automated in 1968, and since "
    "1995 visitors may climb its 164 steps on weekends from May to September. On a clear day the view reaches "
    "the three outer islands and, to the south, the chalk cliffs of Varne.",
    "A ferry leaves the north pier for the islands four times a day in summer and twice a day in winter. The "
    "crossing to the largest island, Storholm, takes forty minutes. Bicycles travel free of charge, but cars "
    "must be booked at least one day in advance.",
    "The town's best known event is the Lantern Festival, held on the last Saturday of August. Children carry "
    "paper lanterns from the market square to the harbour, where a brass band plays until the fishing boats "
    "light their lamps at sunset. The festival began in 1952 to mark the return of the fleet after a storm.",
    "Lindqvist has one secondary school, two primary schools and a public library that opens every day except "
    "Sunday. The library holds a collection of ship logs from the nineteenth century, which researchers may "
    "read in the reading room after booking a place by telephone.",
    "The climate is mild and wet. January is the coldest month, with an average temperature of two degrees, "
    "and July the warmest, with nineteen degrees. Westerly winds bring rain on about one day in two, and fog "
    "often covers the harbour in the early mornings of October and November.",
    "Local food is simple: smoked herring on dark rye bread, fish soup with dill, and a sweet cardamom bun "
    "called a kringle, which bakeries sell warm on Sunday mornings. The market square hosts a fish market every "
    "Tuesday and Friday from seven until noon.",
    "The nearest railway station is in Marstad, twenty-five kilometres inland. A bus connects the station with "
    "the market square every hour between six in the morning and eleven at night; the journey takes thirty-five "
    "minutes and a single ticket costs four euros.",
    "Boat building has a long history in the town. The yard of the Berg family has built wooden sailing boats "
    "since 1890, and its apprentices still learn to bend oak planks with steam. Each spring the yard launches "
    "one new boat, and half the town comes to the slipway to watch it touch the water for the first time.",
    "Walkers can follow the coastal path north from the lighthouse for twelve kilometres to the fishing village "
    "of Ekvik. The path crosses two wooden bridges and passes a colony of puffins that nests on the cliffs from "
    "April to July. Dogs must be kept on a lead during the nesting season.",
    "The small museum of fishing boats on the quay is open from ten to five, Tuesday to Sunday. Entry costs six "
    "euros for adults and is free for children under twelve. Its oldest boat, a rowing boat called Maren, was "
    "found in the harbour mud in 1931 and is thought to be more than three hundred years old.",
    "Visitors can stay at the Harbour Inn, which has twenty rooms above the old sail loft, or at a campsite "
    "behind the dunes south of the town. The campsite is open from April to October and rents out small wooden "
    "cabins with a view of the sea.",
])

# the document: 30 lines of one sentence each (about 3,000 characters)
DOCUMENT = "\n".join([line for paragraph in PARAGRAPHS.split("\n") for line in re.split(r"(?<=\.) ", paragraph)][:30])
QUESTIONS = ["When was Lindqvist founded?", "How tall is the lighthouse?", "Who is the mayor?",
             "How long is the ferry crossing to Storholm?", "When is the Lantern Festival?", "What is a kringle?",
             "Which month is the coldest?", "How much does a bus ticket cost?", "Since when does the Berg yard build "
             "boats?", "How many inhabitants does the town have?"]
MODEL = "gemma-3-270m"
KVSTATE = {"default": [], "off": ["--canonical-chunk", "0"], "before": []}
RUNS = {"raw-agent": 0.0, "raw-paused": 1.0, "raw-shared": 0.0}
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _process(cmd: list[str], env: dict[str, str], port: int) -> Iterator[str]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[:4]} did not start: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=2):
                break
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)  # (a background job ignores SIGINT, and so do its children)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


class Server:
    """One server: its URL, the model name its requests give, and (kvstate) its forwards log."""

    def __init__(self, name: str, url: str, model: str, log: Path | None) -> None:
        self.name, self.url, self.model, self.log = name, url, model, log

    def forwards(self) -> list[int]:
        """The tokens of every forward so far (kvstate servers; [] for others)."""
        return [int(n) for n in self.log.read_text().split()] if self.log else []


@contextlib.contextmanager
def _start(name: str, threads: int, work: Path, before: Path | None, keys: list[str]) -> Iterator[Server]:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if name == "transformers":
        from kvstate.testing.default_model import default_model_folder

        folder = str(default_model_folder())
        cmd = [str(Path(sys.executable).parent / "transformers"), "serve", folder, "--port", str(port), "--dtype",
               "float32", "--log-level", "warning", "--host", "127.0.0.1"]
        with _process(cmd, env, port) as url:
            yield Server(name, url, folder, None)
        return
    log = work / f"{name}.forwards"
    log.write_text("")
    env["KVSTATE_BENCH_FORWARDS"] = str(log)
    if name == "before":
        env["PYTHONPATH"] = str(before / "src")  # type: ignore[operator]
    cmd = [sys.executable, str(Path(__file__).parent / "serve_counted.py"), "serve", "--model", "default", "--port",
           str(port), "--log-level", "warning", "--max-new-tokens", "64", "--dtype", "float32", *KVSTATE[name],
           *(arg for key in keys for arg in ("--api-key", key))]  # a namespace per key: runs share no state
    with _process(cmd, env, port) as url:
        yield Server(name, url, MODEL, log)


def _archive(rev: str, work: Path) -> Path:
    """Commit ``rev``'s tree, unpacked under ``work`` (the main checkout is never touched)."""
    folder = work / f"before-{rev}"
    folder.mkdir()
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=tar, check=True)
    return folder


def _request(server: Server, api: object, prompt: str) -> dict[str, object]:
    """One streamed greedy request: TTFT, total seconds, the answer, usage and the forwards it ran."""
    before = len(server.forwards())
    start = time.perf_counter()
    stream = api.completions.create(model=server.model, prompt=prompt, max_tokens=16,  # type: ignore[attr-defined]
                                    temperature=0, stream=True, stream_options={"include_usage": True})
    ttft, parts, usage = None, [], None
    for chunk in stream:
        text = chunk.choices[0].text if chunk.choices else None
        if text:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            parts.append(text)
        usage = getattr(chunk, "usage", None) or usage
    total = time.perf_counter() - start
    ran = server.forwards()[before:]
    details = getattr(usage, "prompt_tokens_details", None)
    row: dict[str, object] = {
        "ttft_s": round(ttft if ttft is not None else total, 4), "total_s": round(total, 4),
        "cached": getattr(details, "cached_tokens", None), "prompt_tokens": getattr(usage, "prompt_tokens", None),
        "completion_tokens": getattr(usage, "completion_tokens", None), "answer": "".join(parts)}
    if server.log is not None:
        decoded = max(int(row["completion_tokens"] or 0) - 1, 0)  # type: ignore[call-overload]
        row["prompt_forwards"] = ran[:len(ran) - decoded]  # the tokens of each: the decode steps feed one each
    return row


def _conversation(server: Server, key: str, run: str, pause: float) -> list[dict[str, object]]:
    import openai

    api = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=900)
    prompt, rows = DOCUMENT + "\n\n", []
    for i, question in enumerate(QUESTIONS):
        if i:
            time.sleep(pause)
        if run == "raw-shared":
            rows.append(_request(server, api, f"{DOCUMENT}\n\nQ: {question}\nA:"))
            continue
        prompt += f"Q: {question}\nA:"
        rows.append(_request(server, api, prompt))
        prompt += str(rows[-1]["answer"]) + "\n"
    return rows


def _summary(rounds: list[list[dict[str, object]]]) -> dict[str, object]:
    """Per turn, the median over rounds of TTFT and total seconds; cached tokens and forwards of the first round."""
    turns = list(zip(*rounds, strict=True))
    ttft = [statistics.median(float(r["ttft_s"]) for r in turn) for turn in turns]  # type: ignore[arg-type]
    total = [statistics.median(float(r["total_s"]) for r in turn) for turn in turns]  # type: ignore[arg-type]
    first = rounds[0]
    out: dict[str, object] = {
        "cold_ttft_s": round(ttft[0], 4), "warm_ttft_median_s": round(statistics.median(ttft[1:]), 4),
        "ttft_s": [round(t, 4) for t in ttft], "total_s": [round(t, 4) for t in total],
        "cached": [r["cached"] for r in first], "prompt_tokens": [r["prompt_tokens"] for r in first],
        "same_answers_every_round": all([r["answer"] for r in one] == [r["answer"] for r in first] for one in rounds)}
    if "prompt_forwards" in first[0]:
        out["prompt_forwards"] = [len(r["prompt_forwards"]) for r in first]  # type: ignore[arg-type]
        out["prompt_forward_tokens"] = [r["prompt_forwards"] for r in first]
    return out


def _ratios(results: dict[str, dict[str, object]]) -> dict[str, object]:
    """The goals' ratios of TTFT medians: ``default`` over ``off`` (cold, and each warm turn) and ``transformers``
    over ``default`` at turn 10; the same for ``before`` where it ran."""
    def ttft(name: str, run: str) -> list[float]:
        return results[name][run]["summary"]["ttft_s"]  # type: ignore[index]

    out: dict[str, object] = {}
    for name in [n for n in ("default", "before") if n in results]:
        for run in [r for r in RUNS if "off" in results and r in results[name]]:
            mine, off = ttft(name, run), ttft("off", run)
            warm = [round(a / b, 3) for a, b in zip(mine[1:], off[1:], strict=True)]
            out[f"{name}/off {run}"] = {"cold": round(mine[0] / off[0], 3), "warm_turns": warm,
                                         "warm_max": max(warm), "warm_median": statistics.median(warm)}
        for run in [r for r in RUNS if "transformers" in results and r in results["transformers"]]:
            out[f"transformers/{name} {run} turn 10"] = round(ttft("transformers", run)[-1] / ttft(name, run)[-1], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="default,off,transformers", help="of: default, off, transformers")
    parser.add_argument("--before", metavar="REV", help="also run `kvstate serve` of this commit (server 'before')")
    parser.add_argument("--rounds", type=int, default=3, help="every conversation this many times (fresh keys)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", default="serve_reuse", help="results name: bench/results/<out>.json")
    args = parser.parse_args()
    names = args.servers.split(",") + (["before"] if args.before else [])
    samples: dict[str, dict[str, list[list[dict[str, object]]]]] = {n: {} for n in names}
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-reuse-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        before = _archive(args.before, work) if args.before else None
        keys = ["warmup", *(f"{run}-{k}" for run in RUNS for k in range(args.rounds))]
        servers = {name: stack.enter_context(_start(name, args.threads, work, before, keys)) for name in names}
        for server in servers.values():  # load lazily loaded models, warm kernels and allocators
            _request(server, __import__("openai").OpenAI(base_url=server.url + "/v1", api_key="warmup"), "Hello")
        for k in range(args.rounds):  # servers one at a time (the others idle), in a rotated order
            for name in names[k % len(names):] + names[:k % len(names)]:
                for run, pause in RUNS.items():
                    if name == "transformers" and pause:
                        continue  # no prompt cache: a pause changes nothing
                    rows = _conversation(servers[name], f"{run}-{k}", run, pause)
                    samples[name].setdefault(run, []).append(rows)
                    print(f"round {k + 1} {name:12s} {run:10s} ttft {[r['ttft_s'] for r in rows]} "
                          f"forwards {[len(r.get('prompt_forwards', ())) for r in rows]}", flush=True)
    results = {name: {run: {"summary": _summary(rounds), "rounds": rounds} for run, rounds in runs.items()}
               for name, runs in samples.items()}
    ratios = _ratios(results)
    for name, runs in results.items():
        for run, data in runs.items():
            summary = data["summary"]
            print(f"{name:12s} {run:10s} cold {summary['cold_ttft_s']} warm {summary['ttft_s'][1:]} "  # type: ignore[index]
                  f"forwards {summary.get('prompt_forwards')}", flush=True)  # type: ignore[union-attr]
    for what, value in ratios.items():
        print(f"{what}: {value}", flush=True)
    write_results(args.out, {
        "what": "raw Q&A over /v1/completions on the default model (Gemma-3-270M, float32): a 30-line "
                "3,000-character document, then 10 'Q: ...\\nA:' turns of 16 tokens, streamed, greedy",
        "before": args.before, "threads": args.threads, "rounds": args.rounds, "document_chars": len(DOCUMENT),
        "servers": {name: {"flags": KVSTATE.get(name, []), **runs} for name, runs in results.items()},
        "ratios": ratios})


if __name__ == "__main__":
    main()
