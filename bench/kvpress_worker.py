"""The kvpress side of ``bench/bench_ruler.py``: runs in kvpress's own virtual environment, never imports kvstate.

kvpress 0.5.5 needs transformers < 5.3, kvstate >= 5.14 with its default model on >= 5.23, so the
two sides cannot share one environment. ``bench_ruler.py`` writes the token ids of every context
and question once (its prompt formatting, which is kvpress pipeline's own rule) and starts this
script with ``bench/.venv-kvpress/bin/python``; both sides read the same ids and the same float32
safetensors folder that kvstate converted from the packaged GGUF.

For each context: one uncompressed prefill, then for each (press, share) a prefill under the
press, then every question answered on that one compressed cache, greedily, by kvpress's own
pipeline methods (``generate_answer`` and ``_remove_answer_from_cache``, as its ``_forward`` does,
with each task's token budget). Each (context, run) is appended to a JSON-lines file as soon as
it is done, so a crash loses nothing and a rerun resumes.

The slots each press kept are exported per layer and KV head (``kept_slots``): the rows of the
compressed cache matched bitwise to the uncompressed prefill's keys (a press prunes by gathering),
less the slots a head-wise press (AdaKV, KVzip) masks instead of removing. Every export is checked:
the kept keys gathered from the uncompressed cache must equal the compressed cache. kvstate can then
keep exactly those slots, and any answer that still differs is a resume difference, not a choice one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

PRESSES = {  # kvpress's evaluation registry settings of its best question-agnostic presses
    "KNorm": lambda kp: kp.KnormPress(),
    "ExpectedAttention+AdaKV": lambda kp: kp.AdaKVPress(kp.ExpectedAttentionPress(epsilon=1e-2)),
    "KVzip": lambda kp: kp.KVzipPress(),
    "Compactor": lambda kp: kp.CompactorPress(),
    "ChunkKV": lambda kp: kp.ChunkKVPress(press=kp.SnapKVPress(), chunk_length=20),
}


def kept_slots(original: list[torch.Tensor], compressed: list[torch.Tensor],
               masked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]) -> list[torch.Tensor]:
    """Per layer, ``[H, S]`` bool: the context slots each KV head still attends to.

    ``original[i]`` ``[1, H, S, D]``: the uncompressed prefill's keys; ``compressed[i]``
    ``[1, H, k, D]``: the cache after the press (a subset of those rows, in any order);
    ``masked[i]``: kvpress's ``masked_key_indices`` (batch, head, slot) of a head-wise press, or
    None. A compressed row that is not bitwise one of the original rows of its head raises.
    """
    out = []
    for layer, (full, kept, mask) in enumerate(zip(original, compressed, masked, strict=True)):
        _, H, S, _ = full.shape
        slots = torch.zeros(H, S, dtype=torch.bool)
        for h in range(H):
            index = {full[0, h, s].numpy().tobytes(): s for s in range(S)}
            for row in kept[0, h]:
                s = index.get(row.numpy().tobytes())
                if s is None:
                    raise ValueError(f"layer {layer}, head {h}: a kept key is none of the uncompressed keys")
                slots[h, s] = True
        if mask is not None:
            _, heads, seq = mask
            slots[heads.long(), seq.long()] = False
        out.append(slots)
    return out


def check_export(original: list[torch.Tensor], compressed: list[torch.Tensor], slots: list[torch.Tensor],
                 masked: list[object]) -> None:
    """Where a press removed slots (no mask), gathering the kept ones from the uncompressed keys, in slot
    order, must give the compressed cache's rows as a set: the export is then exactly the press's choice."""
    for layer, (full, kept, keep, mask) in enumerate(zip(original, compressed, slots, masked, strict=True)):
        if mask is not None:
            continue
        for h in range(full.shape[1]):
            mine = full[0, h, keep[h]]
            theirs = kept[0, h]
            order = [sorted(t.numpy().tobytes() for t in x) for x in (mine, theirs)]
            if order[0] != order[1]:
                raise ValueError(f"layer {layer}, head {h}: the exported slots do not rebuild the compressed cache")


def save_slots(path: Path, slots: list[torch.Tensor]) -> None:
    """``layer<i>`` as packed bits ``[H, ceil(S / 8)]`` uint8, with ``S`` in the metadata (safetensors)."""
    import numpy as np
    from safetensors.torch import save_file

    tensors = {f"layer{i}": torch.from_numpy(np.packbits(s.numpy(), axis=1)) for i, s in enumerate(slots)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"slots": str(slots[0].shape[1]), "layers": str(len(slots))})


class Clock:
    """Wall and CPU seconds since it started (the CPU's are this process's, which other load inflates less)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def load_slots(path: Path) -> list[torch.Tensor]:
    """The per-layer ``[H, S]`` bool masks ``save_slots`` wrote."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        S, layers = int(meta["slots"]), int(meta["layers"])
        return [torch.from_numpy(np.unpackbits(f.get_tensor(f"layer{i}").numpy(), axis=1)[:, :S].astype(bool))
                for i in range(layers)]


def prefill(model, context: torch.Tensor, press) -> tuple[object, tuple[float, float]]:
    """The cache after kvpress's prefill of ``context`` ``[1, S]`` (under ``press`` when given), and its
    (wall, CPU) seconds."""
    import contextlib

    from transformers import DynamicCache

    torch.manual_seed(0)  # Compactor sketches at random
    cache = DynamicCache()
    clock = Clock()
    with press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=context, past_key_values=cache)
    return cache, clock.read()


def answers(pipe, cache, context_length: int, questions: list[dict]) -> tuple[list[str], tuple[float, float]]:
    """Every question answered greedily on one cache, as kvpress's pipeline ``_forward`` does."""
    out, clock = [], Clock()
    for q in questions:
        lengths = [cache.get_seq_length(i) for i in range(len(cache))]
        out.append(pipe.generate_answer(question_ids=torch.tensor([q["ids"]]), cache=cache,
                                        context_length=context_length, max_new_tokens=q["max_new_tokens"]))
        pipe._remove_answer_from_cache(cache, lengths)
    return out, clock.read()


def cache_keys(cache) -> list[torch.Tensor]:
    return [layer.keys for layer in cache.layers]


def held_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def run_context(setup: dict, ctx: dict, todo: list[str], emit) -> None:
    """The uncompressed run and every (press, share) run of one context not yet done."""
    import kvpress as kp

    model, pipe = setup["model"], setup["pipe"]
    ids = torch.tensor([ctx["context_ids"]])
    S = ids.shape[1]
    cache, (prefill_s, prefill_cpu) = prefill(model, ids, None)
    original, full_bytes = [k.clone() for k in cache_keys(cache)], held_bytes(cache)
    if "kvpress/none/1" in todo:
        got, (answer_s, answer_cpu) = answers(pipe, cache, S, ctx["questions"])
        emit("kvpress/none/1", got, prefill_s=prefill_s, prefill_cpu=prefill_cpu, answer_s=answer_s,
             answer_cpu=answer_cpu, bytes_held=1.0, slots_kept=1.0)
    for run in todo:
        if run == "kvpress/none/1":
            continue
        _, name, share = run.split("/")
        press = PRESSES[name](kp)
        press.compression_ratio = round(1 - float(share), 6)
        cache, (prefill_s, prefill_cpu) = prefill(model, ids, press)
        masked = [getattr(layer.self_attn, "masked_key_indices", None) for layer in model.model.layers]
        slots = kept_slots(original, cache_keys(cache), masked)
        check_export(original, cache_keys(cache), slots, masked)
        if setup["slots_dir"] is not None:
            save_slots(setup["slots_dir"] / ctx["id"].replace("/", "_") / f"{name}_{share}.safetensors", slots)
        kept = sum(int(s.sum()) for s in slots) / sum(s.numel() for s in slots)
        got, (answer_s, answer_cpu) = answers(pipe, cache, S, ctx["questions"])
        emit(run, got, prefill_s=prefill_s, prefill_cpu=prefill_cpu, answer_s=answer_s, answer_cpu=answer_cpu,
             bytes_held=held_bytes(cache) / full_bytes, slots_kept=kept, masked=any(m is not None for m in masked))


def load(folder: str):
    import kvpress
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device="cpu")


def done_runs(path: Path) -> set[tuple[str, str]]:
    if not path.is_file():
        return set()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {(r["context"], r["run"]) for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ids", type=Path, required=True, help="the prompt ids file bench_ruler.py wrote")
    parser.add_argument("--folder", required=True, help="the model's safetensors folder")
    parser.add_argument("--runs", required=True, help="comma-separated kvpress/<press>/<share> and kvpress/none/1")
    parser.add_argument("--out", type=Path, required=True, help="JSON-lines file to append to")
    parser.add_argument("--contexts", default="", help="comma-separated context ids (default: all)")
    parser.add_argument("--slots-dir", type=Path, help="export each press's kept slots here")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("RULER_THREADS", "1")))
    torch.set_grad_enabled(False)
    import kvpress
    import transformers

    transformers.utils.logging.disable_progress_bar()

    model, pipe = load(args.folder)
    setup = {"model": model, "pipe": pipe, "slots_dir": args.slots_dir}
    prompts = json.loads(args.ids.read_text())
    wanted = set(filter(None, args.contexts.split(",")))
    runs, done = args.runs.split(","), done_runs(args.out)
    env = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else _version("kvpress"),
           "transformers": transformers.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    with args.out.open("a") as sink:
        for ctx in prompts["contexts"]:
            todo = [r for r in runs if (ctx["id"], r) not in done]
            if (wanted and ctx["id"] not in wanted) or not todo:
                continue

            def emit(run: str, got: list[str], _ctx: dict = ctx, **facts: object) -> None:
                sink.write(json.dumps({"context": _ctx["id"], "run": run, "answers": got, **facts, "env": env}) + "\n")
                sink.flush()
                os.fsync(sink.fileno())

            start = time.perf_counter()
            run_context(setup, ctx, todo, emit)
            print(f"kvpress {ctx['id']}: {len(todo)} runs in {time.perf_counter() - start:.0f} s", flush=True)


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
