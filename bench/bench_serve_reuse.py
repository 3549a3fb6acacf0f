"""Reuse at agent speed and without a chat template: `kvstate serve` on the default model, turn by turn.

Two conversations through the official ``openai`` client, greedy, not streamed:

* **raw**: ``/v1/completions`` with no chat template, a Q&A over a ~800-token document. The client keeps
  one prompt and appends each answer and the next question to it (``stop: "\\n"``), as agent frameworks
  that send raw prompts do. 8 questions.
* **chat**: ``/v1/chat/completions``, a system prompt and 6 user turns (the fallback template).

Each runs at **agent speed** (the next request as soon as the answer arrives) and **paused** (1 s between
an answer and the next request, a user reading), each in its own API key's namespace of one server, so
they share no pooled state. Servers, one at a time on the same threads:

* ``default``: the canonical schedule as shipped (C = 256; turn marks for chats, line marks for raw prompts);
* ``positions``: ``--no-turn-marks --canonical-chunk 256``: cuts at multiples of 256 only, what raw prompts
  got before line marks (they carry no turn marks);
* ``off``: ``--canonical-chunk 0``: no schedule, a turn feeds only its new tokens in one forward (the
  one-forward limit; exact to float32 rounding only, not bitwise).

Requests are streamed: per turn it records the time to the first text (TTFT: the prefill, and at agent
speed the previous reply's settle, plus one token) and to the end, and ``cached_tokens``; turn 1 is the
cold prefill. The three servers run side by side, one at a time (the others idle), in ``--rounds`` rounds
with fresh keys and a rotated order; the summary takes each turn's median over the rounds.

    python bench/bench_serve_reuse.py                 # about 12 minutes on 2 cores (results: serve_reuse.json)
    python bench/bench_serve_reuse.py --servers default --label before --out serve_reuse_before
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results

SERVERS = {"default": [], "positions": ["--no-turn-marks", "--canonical-chunk", "256"],
           "off": ["--canonical-chunk", "0"]}
RUNS = {"raw-agent": ("raw", 0), "raw-paused": ("raw", 1), "chat-agent": ("chat", 0), "chat-paused": ("chat", 1)}
DOCUMENT = "\n".join([
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
QUESTIONS = ["When was Lindqvist founded?", "How tall is the lighthouse?", "Who is the mayor?",
             "How long is the ferry crossing to Storholm?", "When is the Lantern Festival?",
             "What is a kringle?", "Which month is the coldest?", "How much does a bus ticket cost?"]
CHAT = ["Hi! I am planning a trip to a harbour town. Any tips?", "What should I pack for rain?",
        "Is a ferry trip worth it?", "What local food should I try?", "How do I get there without a car?",
        "Thanks! Anything else?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(extra: list[str], threads: int, keys: list[str]) -> Iterator[str]:
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.Popen([sys.executable, "-m", "kvstate.cli", "serve", "--model", "default", "--port", str(port),
                             "--log-level", "warning", "--max-new-tokens", "64",
                             *(arg for key in keys for arg in ("--api-key", key)), *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
            with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=2):
                break
            time.sleep(0.3)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)


def _streamed(start: float, stream: Iterator[object], text_of: Callable[[object], str | None]) -> dict[str, object]:
    """TTFT (to the first chunk with text, or to the end for an empty answer), total seconds, the answer and the
    usage of a streamed request sent at ``start``."""
    ttft, parts, usage = None, [], None
    for chunk in stream:
        text = text_of(chunk) if getattr(chunk, "choices", None) else None
        if text:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            parts.append(text)
        usage = getattr(chunk, "usage", None) or usage
    total = time.perf_counter() - start
    return {"ttft_s": round(ttft if ttft is not None else total, 4), "total_s": round(total, 4),
            "cached": usage.prompt_tokens_details.cached_tokens, "prompt_tokens": usage.prompt_tokens,  # type: ignore[union-attr]
            "completion_tokens": usage.completion_tokens, "answer": "".join(parts)}  # type: ignore[union-attr]


def _raw(api: object, pause: float) -> list[dict[str, object]]:
    prompt, rows = DOCUMENT + "\n\n", []
    for i, question in enumerate(QUESTIONS):
        prompt += f"Question: {question}\nAnswer:"
        if i:
            time.sleep(pause)
        start = time.perf_counter()
        stream = api.completions.create(model="gemma-3-270m", prompt=prompt, max_tokens=32,  # type: ignore[attr-defined]
                                        temperature=0, stop=["\n"], stream=True,
                                        stream_options={"include_usage": True})
        rows.append(_streamed(start, stream, lambda c: c.choices[0].text))
        prompt += str(rows[-1]["answer"]) + "\n"
    return rows


def _chat(api: object, pause: float) -> list[dict[str, object]]:
    messages, rows = [{"role": "system", "content": "You are a friendly travel guide. Answer briefly."}], []
    for i, question in enumerate(CHAT):
        messages.append({"role": "user", "content": question})
        if i:
            time.sleep(pause)
        start = time.perf_counter()
        stream = api.chat.completions.create(model="gemma-3-270m", messages=messages,  # type: ignore[attr-defined]
                                             max_tokens=32, temperature=0, stream=True,
                                             stream_options={"include_usage": True})
        rows.append(_streamed(start, stream, lambda c: c.choices[0].delta.content))
        messages.append({"role": "assistant", "content": str(rows[-1]["answer"])})
    return rows


def _summary(rounds: list[list[dict[str, object]]]) -> dict[str, object]:
    """Per turn, the median over rounds of TTFT and total seconds; the warm turns' median of those medians."""
    turns = list(zip(*rounds, strict=True))
    ttft = [statistics.median(float(r["ttft_s"]) for r in turn) for turn in turns]
    total = [statistics.median(float(r["total_s"]) for r in turn) for turn in turns]
    first = rounds[0]
    return {"cold_ttft_s": round(ttft[0], 4), "warm_ttft_median_s": round(statistics.median(ttft[1:]), 4),
            "warm_total_median_s": round(statistics.median(total[1:]), 4),
            "ttft_s": [round(t, 4) for t in ttft], "total_s": [round(t, 4) for t in total],
            "cached": [r["cached"] for r in first], "prompt_tokens": [r["prompt_tokens"] for r in first],
            "same_answers_every_round": all([r["answer"] for r in one] == [r["answer"] for r in first]
                                            for one in rounds)}


def main() -> None:
    import openai

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default=",".join(SERVERS), help="which of: " + ", ".join(SERVERS))
    parser.add_argument("--rounds", type=int, default=3, help="each conversation this many times (fresh keys)")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between turns in the paused runs")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--label", default="", help="recorded in the results (say, the code the server ran)")
    parser.add_argument("--out", default="serve_reuse", help="results name: bench/results/<out>.json")
    args = parser.parse_args()
    names = args.servers.split(",")
    keys = [f"{run}-{k}" for run in RUNS for k in range(args.rounds)]
    samples: dict[str, dict[str, list[list[dict[str, object]]]]] = {n: {run: [] for run in RUNS} for n in names}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(_server(SERVERS[name], args.threads, keys)) for name in names}
        for url in urls.values():  # warm every server up (kernels, allocator)
            openai.OpenAI(base_url=url + "/v1", api_key=keys[0]).completions.create(
                model="gemma-3-270m", prompt="Hello", max_tokens=2)
        for k in range(args.rounds):  # servers one at a time (the others idle), in a rotated order
            for name in names[k % len(names):] + names[:k % len(names)]:
                for run, (kind, pause) in RUNS.items():
                    api = openai.OpenAI(base_url=urls[name] + "/v1", api_key=f"{run}-{k}", max_retries=0,
                                        timeout=600)
                    rows = (_raw if kind == "raw" else _chat)(api, pause * args.pause)
                    samples[name][run].append(rows)
                    print(f"round {k + 1} {name:9s} {run:12s} ttft {[r['ttft_s'] for r in rows]} "
                          f"cached {[r['cached'] for r in rows]}", flush=True)
    results = {name: {"flags": SERVERS[name], **{run: {"summary": _summary(rounds), "rounds": rounds}
                                                for run, rounds in runs.items()}} for name, runs in samples.items()}
    for name, runs in results.items():
        for run in RUNS:
            print(f"{name:9s} {run:12s} {runs[run]['summary']}", flush=True)  # type: ignore[index]
    write_results(args.out, {"label": args.label, "pause_s": args.pause, "threads": args.threads,
                             "rounds": args.rounds, "model": "gemma-3-270m float32 (the default model)",
                             "servers": results})


if __name__ == "__main__":
    main()
