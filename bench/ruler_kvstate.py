"""The kvstate side of ``bench/bench_ruler.py``, and the prompt ids both sides read.

Prompts follow kvpress pipeline's rule, so both libraries see the same tokens: with a chat
template, the user turn holds the context and then the question, and the context ids are the
template up to the question; the question ids are the question, the rest of the template (the
end of the user turn and the assistant header) and the answer prefix. Without one (Gemma-3-270M
here is the pretrained model), the context is ``<bos>`` + text and the question ends in a newline.

For each context: one prefill, then one compression per (policy, share) from that state, each
compressed state forked per question and answered greedily; question-aware runs compress per
question (the question's attention scores the slots). Each (context, run) is appended to a
JSON-lines file as soon as it is done, so a crash loses nothing and a rerun resumes.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common import commit
from kvpress_worker import load_slots

MODELS = {"smollm2": "smollm2", "gemma3": "default"}  # bench name -> kvstate.models.load_model spec


def prompt_ids(tokenizer: Any, context: str, question: dict) -> tuple[list[int], list[int]]:
    """``(context ids, question ids)`` by kvpress's ``KVPressTextGenerationPipeline.preprocess`` rule."""
    if tokenizer.chat_template is None:
        text, suffix = (tokenizer.bos_token or "") + context, "\n"
    else:
        separator = "#" * (len(context) + 10)
        templated = tokenizer.apply_chat_template([{"role": "user", "content": context + separator}],
                                                  add_generation_prompt=True, tokenize=False)
        text, suffix = templated.split(separator)
    asked = question["question"] + suffix + question["answer_prefix"]
    encode = lambda s: list(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    return encode(text), encode(asked)


def write_ids(model: str, tokenizer: Any, contexts: list[dict], path: Path) -> Path:
    """The prompt ids of every context and question of ``model``, for both sides (JSON)."""
    rows = []
    for ctx in contexts:
        questions = []
        for q in ctx["questions"]:
            context_ids, question_ids = prompt_ids(tokenizer, ctx["text"][model], q)
            questions.append({"ids": question_ids, "max_new_tokens": q["max_new_tokens"]})
        rows.append({"id": ctx["id"], "context_ids": context_ids, "questions": questions})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "contexts": rows}))
    return path


def agnostic(tokenizer: Any) -> dict[str, Callable[[float], Any]]:
    """kvstate's question-agnostic policies by name, each a factory of the eviction ratio."""
    from kvstate import compress as c

    # KVzip's re-read instruction: today it is token ids the caller passes; a KVzip whose default is not
    # the empty prompt builds its own (inside the chat template) and is called with the ratio alone
    prompt = c.kvzip_prompt(tokenizer) if c.KVzip.__dataclass_fields__["prompt"].default == () else None
    table: dict[str, Callable[[float], Any]] = {
        "KNorm": lambda r: c.KNorm(r),
        "KVzip": lambda r: c.KVzip(r) if prompt is None else c.KVzip(r, prompt=prompt),
        "ExpectedAttention": lambda r: c.ExpectedAttention(r),
        "SnapKV": lambda r: c.SnapKV(r, window=16, kernel=5),
        "StreamingLLM": lambda r: c.StreamingLLM(r, sinks=4),
        "Random": lambda r: c.Random(r, seed=0),
    }
    # the ratio of the entries kept (each layer's padding to its fullest head holds more bytes), every head of
    # a layer keeping as many slots (no padding), and the padded cut unfilled (the default before "filled");
    # these rows were made when the re-read also re-read the chat template's prefix (prefix="reread")
    table["KVzipEntries"] = lambda r: c.KVzip(r, count="entries", prefix="reread")
    table["KVzipPadded"] = lambda r: c.KVzip(r, count="padded", prefix="reread")
    table["KVzipBytes"] = lambda r: c.KVzip(r, count="bytes", prefix="reread")
    table["KVzipReread"] = lambda r: c.KVzip(r, prefix="reread")
    # kvpress's KVzipPress exactly: its prefix rule and its count (the same slots, bench/kvzip_overlap.py)
    table["KVzipEvictEntries"] = lambda r: c.KVzip(r, count="entries", prefix="evict")
    table["KVzipEvict"] = lambda r: c.KVzip(r, prefix="evict")
    table["ExpectedAttentionPadded"] = lambda r: c.ExpectedAttention(r, count="padded")
    table["ExpectedAttentionEntries"] = lambda r: c.ExpectedAttention(r, count="entries")
    table["ExpectedAttentionBytes"] = lambda r: c.ExpectedAttention(r, count="bytes")
    # hybrid models (Gemma 3): every attention layer in one ranking even when the sliding layers could stay whole
    table["KVzipRanked"] = lambda r: c.KVzip(r, sliding="ranked")
    table["KVzipRecent"] = lambda r: c.KVzip(r, sliding="recent")
    # the question-aware winner's hybrid rule (SnapKV21Hybrid: Ada-KV's floor 0.2, each sliding head's floor its
    # best-scored slots, the rest its newest; KVzipRecent's choice ignores the scores wherever the full layers stay
    # whole), and KVzip+'s normalised score; both chosen before they ran
    table["KVzipHybrid"] = lambda r: c.KVzip(r, sliding="recent", floor=0.2)
    table["KVzipPlus"] = lambda r: c.KVzip(r, normalize=True)
    if hasattr(c, "ChunkKV"):  # the span wrapper, once the library has it
        table["ChunkKV"] = lambda r: c.ChunkKV(policy=c.KVzip(r))
    return table


def aware() -> dict[str, Callable[[float], Any]]:
    """Question-aware policies (``compress(policy, query_ids=question)``). ``SnapKV21`` pools over 21 slots:
    both models write a number one digit per token, so a 7-digit value spans 8 slots after the key the
    question finds, which 5-slot pooling cuts (kernel chosen on contexts 0-3 of each kind, see
    docs/compression.md)."""
    from kvstate.compress import SnapKV

    return {"SnapKV": lambda r: SnapKV(r, window=16, kernel=5),
            "SnapKVHeads": lambda r: SnapKV(r, window=16, kernel=5, heads=True),
            "SnapKV21": lambda r: SnapKV(r, window=16, kernel=21),
            # one ranking over every layer; on a hybrid model the full layers take the budget first, the sliding
            # layers keeping their floors (Ada-KV's 20%) where both kinds cannot give it alone
            "SnapKV21Hybrid": lambda r: SnapKV(r, window=16, kernel=21, scope="global", sliding="recent", floor=0.2)}


def keep_policy(slots: list[torch.Tensor]) -> Any:
    """kvstate's policy that keeps exactly ``slots`` (per layer ``[H, S]`` bool), for the cross-check.

    ``Keep`` takes ``{layer index: [[kept slots of KV head 0], [head 1], ...]}``; slot ``j`` is token
    ``j`` of the uncompressed prefill, as in kvpress's cache.
    """
    from kvstate import compress

    if not hasattr(compress, "Keep"):
        raise SystemExit("this kvstate has no Keep policy (per-head slot indices) yet: the cross-check needs it")
    return compress.Keep({i: [head.nonzero()[:, 0].tolist() for head in layer] for i, layer in enumerate(slots)})


def kv_bytes(state: Any) -> int:
    """Bytes of the K/V tensors a state holds (positions and recurrent state excluded)."""
    return sum(t.numel() * t.element_size() for layer in state.layers for name, t in layer.tensors().items()
               if name in ("keys", "values"))


class Clock:
    """Wall and CPU seconds since it started (the CPU's are this process's, which other load inflates less)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


class Runner:
    """One model's kvstate runs over the contexts of a prompt ids file."""

    def __init__(self, model_name: str, slots_dir: Path | None) -> None:
        from kvstate.models import load_model

        self.model, self.tokenizer = load_model(MODELS[model_name], progress=False)
        self.policies, self.aware, self.slots_dir = agnostic(self.tokenizer), aware(), slots_dir

    def answer(self, session: Any, context: torch.Tensor, question: dict) -> str:
        history = torch.cat([context, torch.tensor([question["ids"]])], 1)
        out = session.fork().generate(history, max_new_tokens=question["max_new_tokens"], do_sample=False)
        return self.tokenizer.decode(out[0], skip_special_tokens=True)

    def context(self, ctx: dict, todo: list[str], emit: Callable[..., None]) -> None:
        from kvstate import Session

        ids = torch.tensor([ctx["context_ids"]])
        base, clock = Session(self.model), Clock()
        base.extend(ids)
        prefill_s, prefill_cpu = clock.read()
        full = kv_bytes(base.state)
        plain = {"plain_prefill_cpu": self.plain_prefill(ids)} if "kvstate/KVzip/0.5" in todo else {}
        for run in todo:
            side, name, share = run.split("/")
            if side == "aware":
                got, (compress_s, compress_cpu), (answer_s, answer_cpu), held, kept = self.aware_run(
                    base, ids, ctx["questions"], self.aware[name](round(1 - float(share), 6)))
            else:
                session, clock, kept = base.fork(), Clock(), 1.0
                if side == "keep":
                    kept = session.compress(keep_policy(load_slots(self.slots_dir / ctx["id"].replace("/", "_") /
                                                                   f"{name}_{share}.safetensors"))).entries_kept
                elif name != "none":
                    kept = session.compress(self.policies[name](round(1 - float(share), 6))).entries_kept
                (compress_s, compress_cpu), clock = clock.read(), Clock()
                got = [self.answer(session, ids, q) for q in ctx["questions"]]
                (answer_s, answer_cpu), held = clock.read(), kv_bytes(session.state)
            emit(run, got, prefill_s=prefill_s, prefill_cpu=prefill_cpu, compress_s=compress_s,
                 compress_cpu=compress_cpu, answer_s=answer_s, answer_cpu=answer_cpu, bytes_held=held / full,
                 slots_kept=kept, **(plain if run == "kvstate/KVzip/0.5" else {}))

    def plain_prefill(self, ids: torch.Tensor) -> float:
        """CPU seconds of the context in one plain transformers forward into a ``DynamicCache``: the cheapest
        correct prefill, the fair baseline of KVzip's scoring cost (``bench/bench_kvzip_cost.py``'s)."""
        from transformers import DynamicCache

        from kvstate._compat.core import cache_kwarg

        cache, clock = DynamicCache(config=self.model.config), Clock()
        self.model(ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(self.model): cache})
        return clock.read()[1]

    def aware_run(self, base: Any, ids: torch.Tensor, questions: list[dict], policy: Any) -> tuple[
            list[str], tuple[float, float], tuple[float, float], float, float]:
        """Each question compresses its own fork with its own attention: answers, (wall, CPU) seconds of the
        compressions and of the answers, mean bytes held, mean share of entries kept."""
        got, spent, answering, held, kept = [], [0.0, 0.0], [0.0, 0.0], 0.0, 0.0
        for q in questions:
            session, clock = base.fork(), Clock()
            kept += session.compress(policy, query_ids=torch.tensor([q["ids"]])).entries_kept / len(questions)
            spent = [a + b for a, b in zip(spent, clock.read(), strict=True)]
            held += kv_bytes(session.state) / len(questions)
            clock = Clock()
            got.append(self.answer(session, ids, q))
            answering = [a + b for a, b in zip(answering, clock.read(), strict=True)]
        return got, (spent[0], spent[1]), (answering[0], answering[1]), held, kept


def done_runs(path: Path) -> set[tuple[str, str]]:
    if not path.is_file():
        return set()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["context"], r["run"]) for r in rows}


def work(model_name: str, ids_path: Path, runs: list[str], out: Path, contexts: set[str],
         slots_dir: Path | None) -> None:
    """Append every (context, run) of ``runs`` not yet in ``out``; one torch thread."""
    torch.set_num_threads(int(os.environ.get("RULER_THREADS", "1")))
    torch.set_grad_enabled(False)
    prompts, done = json.loads(ids_path.read_text()), done_runs(out)
    runner = Runner(model_name, slots_dir)
    head = commit()
    with out.open("a") as sink:
        for ctx in prompts["contexts"]:
            todo = [r for r in runs if (ctx["id"], r) not in done]
            if (contexts and ctx["id"] not in contexts) or not todo:
                continue

            def emit(run: str, got: list[str], _ctx: dict = ctx, **facts: object) -> None:
                sink.write(json.dumps({"context": _ctx["id"], "run": run, "answers": got, **facts,
                                       "commit": head}) + "\n")
                sink.flush()
                os.fsync(sink.fileno())

            start = time.perf_counter()
            runner.context(ctx, todo, emit)
            print(f"kvstate {model_name} {ctx['id']}: {len(todo)} runs in {time.perf_counter() - start:.0f} s",
                  flush=True)
