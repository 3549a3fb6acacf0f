"""Does `transformers serve --continuous-batching` give each request its one-at-a-time answer?

kvstate's batching promises answers that never depend on who else was asking; this records
whether the baseline it is measured against keeps that promise. One `transformers serve
--continuous-batching` process on the default model's folder (the same float32 weights and
template as ``bench_serve.py``), per dtype: 8 greedy chat requests of different lengths, first
one at a time, then all 8 at once (8 threads, released together). Each concurrent answer is
compared with the same request's one-at-a-time answer, as text (what the API returns).

    python bench/bench_tf_cb_exactness.py     # about 3 minutes on 2 cores

Results: ``bench/results/tf_cb_exactness.json`` (commit, versions, cores, per request equal or not).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import QUESTIONS, SYSTEM, _free_port, _model_folder, _server
from common import write_results

CONCURRENT = 8


def _requests() -> list[list[dict[str, str]]]:
    """8 chats of different lengths: a question alone, or after the system prompt, or after earlier turns."""
    chats = []
    for i in range(CONCURRENT):
        messages = [{"role": "system", "content": SYSTEM}] if i % 2 else []
        messages += [{"role": "user", "content": q} for q in QUESTIONS[i:i + 1 + i // 3]]
        chats.append(messages)
    return chats


def _ask(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, int]:
    import openai

    api = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=900)
    r = api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content or "", r.usage.completion_tokens if r.usage else 0


def _alone(url: str, model: str, chats: list, max_tokens: int) -> tuple[list[str], float, int]:
    start, answers, tokens = time.perf_counter(), [], 0
    for messages in chats:
        text, n = _ask(url, model, messages, max_tokens)
        answers.append(text)
        tokens += n
    return answers, time.perf_counter() - start, tokens


def _together(url: str, model: str, chats: list, max_tokens: int) -> tuple[list[str], float, int]:
    answers: list[tuple[str, int] | None] = [None] * len(chats)
    gate = threading.Barrier(len(chats) + 1)

    def one(i: int) -> None:
        gate.wait()
        answers[i] = _ask(url, model, chats[i], max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(chats))]
    for t in threads:
        t.start()
    gate.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    assert all(a is not None for a in answers), "a concurrent request failed"
    return [a[0] for a in answers], seconds, sum(a[1] for a in answers)  # type: ignore[index]


def _run(folder: Path, dtype: str, threads: int, max_tokens: int) -> dict[str, object]:
    port = _free_port()
    cmd = [str(Path(sys.executable).parent / "transformers"), "serve", str(folder), "--continuous-batching",
           "--port", str(port), "--dtype", dtype, "--log-level", "warning", "--host", "127.0.0.1"]
    chats = _requests()
    with _server(cmd, port, threads) as url:
        _ask(url, str(folder), [{"role": "user", "content": "Hello"}], 2)  # loads the model, warms the kernels
        alone, alone_s, alone_tokens = _alone(url, str(folder), chats, max_tokens)
        together, together_s, together_tokens = _together(url, str(folder), chats, max_tokens)
    equal = [a == b for a, b in zip(alone, together, strict=True)]
    print(f"{dtype}: {sum(equal)}/{len(equal)} concurrent answers equal their one-at-a-time answers; "
          f"{alone_tokens / alone_s:.1f} tok/s alone, {together_tokens / together_s:.1f} tok/s at {CONCURRENT}",
          flush=True)
    return {"equal": equal, "all_equal": all(equal), "alone_tokens_per_s": round(alone_tokens / alone_s, 2),
            "concurrent_tokens_per_s": round(together_tokens / together_s, 2),
            "answers": [{"alone": a, "concurrent": b} for a, b in zip(alone, together, strict=True)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per answer (the batching goal's 32)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvstate-bench-tfcb-"))
    try:
        folder = _model_folder(work)
        results = {dtype: _run(folder, dtype, args.threads, args.max_tokens) for dtype in args.dtypes}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results("tf_cb_exactness", {
        "what": f"transformers serve --continuous-batching on the default model: {CONCURRENT} greedy chat requests "
                "one at a time, then all at once; is each concurrent answer (text) its one-at-a-time answer?",
        "max_tokens": args.max_tokens, "threads": args.threads, "requests": CONCURRENT, "results": results})


if __name__ == "__main__":
    main()
