"""Bitwise cold = warm on one device at real sizes, and what the canonical schedule costs there, as one prepared
script (one GPU run; tried on the CPU first at small shapes).

1. **Kernels**: one attention call of the big shape (a 512-token chunk after a cache of 1k, 4k, 16k keys) on every
   backend (PyTorch's default pick with transformers' dense mask, flash with the causal bias aligned to the last
   key, the math kernel, memory-efficient), three times each: run-to-run bitwise or not, and the time.
2. **Tiny families**, as the suite has them (llama, gemma3_text, qwen3_vl with a video, lfm2): every warm path
   (next turn, fork, state file, prefix store, truncate) against a cold run (a new ``Session`` on the whole
   history), and three cold runs against each other.
3. **The big model** (a Qwen3-8B shape with random weights, built on the device from its config; no download):
   the same matrix at each ``--lengths`` (4k and 16k tokens), the default attention, the device's canonical chunk.
4. **Costs** on the big model, for each ``--chunks`` C: the cold prefill of 4k tokens against plain
   ``model.generate``'s time to first token on the same ids, and a 16-token warm turn after 4k against plain
   ``generate`` continuing a ``DynamicCache`` (median of 5 after a warm-up, synchronized).

JSON goes to ``--out`` after every step (a deadline or a crash keeps what was measured), with the commit, versions
and device name, and a top-level ``summary``: ``bitwise_all``, ``repeat_bitwise``, ``max_history``,
``cold_prefill_vs_plain`` and ``warm_turn_vs_plain_cache`` (time ratios kvstate / plain at the device's chunk).

    python scripts/device_check.py --out bench/results/device_check_cuda.json           # on a GPU, ~6 min (H200)
    python scripts/device_check.py --device cpu --shape small --lengths 96 160 --chunks 16 32 --cost-length 100 \\
        --tiny tiny:llama --out /tmp/device_check.json                                   # the CPU trial, ~1 min
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from common import commit, dirty

N = 8  # greedy tokens per run
TINY_CHUNK = 16  # the tiny histories are short: small chunks so they resume from several cuts
SHAPES = {  # the big model: Qwen3-8B's shape, and a small stand-in for the CPU trial
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512),
}


class Deadline(Exception):
    """The script's own time limit: what was measured so far is kept."""


class Run:
    """The report being built: written to ``out`` after every step, and a deadline checked before each."""

    def __init__(self, args: argparse.Namespace) -> None:
        import transformers

        import kvstate

        self.args, self.began = args, time.perf_counter()
        self.report: dict = {"device": args.device, "device_name": _device_name(args.device), "dtype": args.dtype,
                             "commit": commit(), "dirty": dirty(),
                             "kvstate": kvstate.__version__, "torch": torch.__version__,
                             "transformers": transformers.__version__, "new_tokens": N, "kernels": [],
                             "tiny": [], "big": [], "costs": [], "incomplete": None}

    def step(self, name: str) -> None:
        if time.perf_counter() - self.began > self.args.deadline:
            raise Deadline(f"deadline of {self.args.deadline} s reached before {name}")
        print(f"[{time.perf_counter() - self.began:6.1f} s] {name}", flush=True)

    def save(self) -> None:
        self.report["seconds"] = round(time.perf_counter() - self.began, 1)
        self.report["summary"] = summary(self.report, self.args)
        if self.args.out is not None:
            self.args.out.parent.mkdir(parents=True, exist_ok=True)
            self.args.out.write_text(json.dumps(self.report, indent=2) + "\n")


# ----- 1. kernels ---------------------------------------------------------------------------------------------------
def kernel_probe(device: str, dtype: torch.dtype, shape: dict, keys: int, chunk: int = 512) -> dict[str, dict]:
    """One attention call of ``chunk`` queries after ``keys - chunk`` cached keys, per backend: bitwise over three
    runs, max |Δ| between them, and the median time in ms (``error`` where the backend refuses the call)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from kvstate._compat.attention import flash

    chunk = min(chunk, keys)
    heads, dim = shape["num_attention_heads"], shape["head_dim"]
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, chunk, dim, generator=gen, device=device, dtype=dtype)
    k, v = (torch.randn(1, heads, keys, dim, generator=gen, device=device, dtype=dtype) for _ in range(2))
    dense = torch.ones(chunk, keys, dtype=torch.bool, device=device).tril(keys - chunk)[None, None]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = {"default (dense mask)": lambda: sdpa(q, k, v, attn_mask=dense),
             "math (dense mask)": lambda: _with(sdpa_kernel(SDPBackend.MATH), lambda: sdpa(q, k, v, attn_mask=dense)),
             "efficient (dense mask)": lambda: _with(sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION),
                                                     lambda: sdpa(q, k, v, attn_mask=dense))}
    if device == "cuda":
        calls["flash (lower-right causal, kvstate)"] = lambda: flash(q, k, v, dim ** -0.5, causal=True)
    out, firsts = {}, {}
    for name, call in calls.items():
        try:
            results, ms = [], []
            for _ in range(3):
                begin = _now(device)
                results.append(call())
                ms.append((_now(device) - begin) * 1000)
        except RuntimeError as exc:
            out[name] = {"error": str(exc)[:200]}
            continue
        firsts[name] = results[0]
        out[name] = {"bitwise": all(torch.equal(results[0], r) for r in results[1:]),
                     "max_abs": max((results[0].float() - r.float()).abs().max().item() for r in results[1:]),
                     "ms": round(statistics.median(ms), 3)}
    math = firsts.get("math (dense mask)")
    for name, first in firsts.items():  # every backend computes the same attention, within rounding
        if math is not None:
            out[name]["vs_math"] = (first.float() - math.float()).abs().max().item()
    return out


# ----- 2, 3. the matrix ---------------------------------------------------------------------------------------------
def generate(session, ids: torch.Tensor, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens ``[1, N]`` and every step's logits; a media model never writes a media placeholder (the next
    turn passes the same pixels, which would not cover a generated one)."""
    config = session.model.config
    media = [getattr(config, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                          "vision_end_token_id") if getattr(config, k, None) is not None]
    out = session.generate(ids, max_new_tokens=N, do_sample=False, return_dict_in_generate=True, output_logits=True,
                           **({"suppress_tokens": media} if media else {}), **inputs)
    return out.sequences, torch.cat(out.logits)


def matrix(model, ids: torch.Tensor, inputs: dict, folder: Path, chunk: int) -> dict[str, dict]:
    """Every warm path and two more cold runs against the cold run: ``{path: {bitwise, max_abs, reused}}``."""
    from kvstate import PrefixStore, Session

    colds: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def cold(history):
        key = tuple(history[0].tolist())
        if key not in colds:  # one cold run per history: each warm path is checked against it
            colds[key] = generate(Session(model, canonical_chunk=chunk), history, inputs)
        return colds[key]

    def compare(name, warm, reference, reused):
        same = torch.equal(warm[0], reference[0]) and torch.equal(warm[1], reference[1])
        gap = (warm[1].float() - reference[1].float()).abs().max().item() if warm[1].shape == reference[1].shape \
            else float("inf")
        out[name] = {"bitwise": same, "max_abs": gap, "reused": reused}

    out: dict[str, dict] = {}
    first = cold(ids)
    for i in (2, 3):  # the same cold run again, twice
        compare(f"cold run #{i}", generate(Session(model, canonical_chunk=chunk), ids, inputs), first, 0)
    s = Session(model, canonical_chunk=chunk, store=PrefixStore(folder / "store", chunk_tokens=chunk))
    answer = generate(s, ids, inputs)[0]
    extra = ids[:, -16:]  # a 16-token turn from the same vocabulary (the history ends in text)
    turn2 = torch.cat([ids, answer, extra], 1)
    fork = s.fork()
    s.save(folder / "turn1.kvs")
    compare("next turn", generate(s, turn2, inputs), cold(turn2), s.last_plan.reused)
    branch = torch.cat([ids, answer[:, :2], extra.flip(1)], 1)
    compare("fork", generate(fork, branch, inputs), cold(branch), fork.last_plan.reused)
    loaded = Session.load(folder / "turn1.kvs", model)
    compare("state file", generate(loaded, turn2, inputs), cold(turn2), loaded.last_plan.reused)
    hit = Session(model, canonical_chunk=chunk, store=PrefixStore(folder / "store", chunk_tokens=chunk))
    compare("prefix store", generate(hit, turn2, inputs), cold(turn2), hit.last_plan.reused)
    back, cut = s.fork(), ids.shape[1] - 5
    if not back.state.rollback_limit(cut):
        back.truncate(cut)
        shorter = torch.cat([ids[:, :cut], extra], 1)
        compare("truncate", generate(back, shorter, inputs), cold(shorter), back.last_plan.reused)
    return out


def tiny(spec: str, device: str, dtype: str) -> tuple:
    """``(model, history ids [1, L], media inputs)`` of a tiny family (qwen3_vl's history holds a video)."""
    from kvstate.models import load_model
    from kvstate.models.tiny import tiny_prompt
    from kvstate.selfcheck import adapter_for

    model = load_model(spec, None, progress=False, dtype=dtype, device=device)[0]
    if spec == "tiny:qwen3_vl":
        span, inputs = adapter_for(model).synthetic_video(model)
        ids = torch.cat([tiny_prompt(9), span, tiny_prompt(30, seed=3)], 1).to(model.device)
        return model, ids, {k: v.to(model.device) for k, v in inputs.items()}
    return model, tiny_prompt(45).to(model.device), {}


def big(shape: str, device: str, dtype: torch.dtype, longest: int):
    """A Qwen3 model of ``shape`` with random weights, built on ``device`` (the weights do not change the bits'
    behaviour nor the times)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**SHAPES[shape], max_position_embeddings=max(40960, 2 * longest), rope_theta=1e6,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


# ----- 4. costs -----------------------------------------------------------------------------------------------------
def costs(model, length: int, chunk: int, device: str) -> dict[str, float]:
    """Cold prefill of ``length`` tokens (kvstate, time to first token) against plain ``generate``'s, and a 16-token
    warm turn after it against plain ``generate`` continuing a ``DynamicCache`` of the same history; ms."""
    import copy

    from kvstate import Session
    from kvstate._compat.core import CACHE_KWARG  # the keyword a transformers cache travels in (it moved in 5.24)

    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(100, vocab, (1, length + 24), generator=gen).to(device)
    history, answer_turn = ids[:, :length], ids[:, :length + 24]  # 8 answer tokens, then the 16-token turn
    one = dict(max_new_tokens=1, do_sample=False)
    plain_cold = _median(device, lambda: model.generate(history, attention_mask=torch.ones_like(history), **one))
    ours_cold = _median(device, lambda: Session(model, canonical_chunk=chunk).run(history, **one))
    state = Session(model, canonical_chunk=chunk)
    state.run(ids[:, :length + 8], **one)  # the history and its answer, as a chat's state after a reply
    ours_warm = _median(device, lambda: state.fork().run(answer_turn, **one))
    with torch.no_grad():
        cache = getattr(model(ids[:, :length + 8], use_cache=True), CACHE_KWARG)
    copies = iter([copy.deepcopy(cache) for _ in range(6)])
    plain_warm = _median(device, lambda: model.generate(answer_turn, attention_mask=torch.ones_like(answer_turn),
                                                        **{CACHE_KWARG: next(copies)}, **one))
    return {"chunk": chunk, "length": length, "cold_ms": ours_cold, "plain_cold_ms": plain_cold,
            "cold_vs_plain": round(ours_cold / plain_cold, 3), "warm_turn_ms": ours_warm,
            "plain_cache_turn_ms": plain_warm, "warm_vs_plain_cache": round(ours_warm / plain_warm, 3)}


def summary(report: dict, args: argparse.Namespace) -> dict:
    matrices = [r["paths"] for r in report["tiny"] + report["big"]]
    chosen = [c for c in report["costs"] if c["chunk"] == args.chunk]
    return {"bitwise_all": bool(matrices) and all(p["bitwise"] for m in matrices for p in m.values()),
            "repeat_bitwise": bool(matrices) and all(p["bitwise"] for m in matrices for name, p in m.items()
                                                     if name.startswith("cold run")),
            "max_history": max((r["length"] for r in report["big"] if all(p["bitwise"] for p in r["paths"].values())),
                               default=0),
            "cold_prefill_vs_plain": chosen[0]["cold_vs_plain"] if chosen else None,
            "warm_turn_vs_plain_cache": chosen[0]["warm_vs_plain_cache"] if chosen else None,
            "chunk": args.chunk}


# ----- the run ------------------------------------------------------------------------------------------------------
def main() -> int:
    from kvstate.schedule import default_chunk

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tiny", nargs="*", default=["tiny:llama", "tiny:gemma3_text", "tiny:qwen3_vl", "tiny:lfm2"])
    parser.add_argument("--tiny-dtypes", nargs="*", default=None, help="the tiny matrix's dtypes (default: --dtype)")
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--lengths", nargs="*", type=int, default=[4096, 16384], help="big-model histories")
    parser.add_argument("--chunks", nargs="*", type=int, default=[256, 512, 1024], help="C values to cost")
    parser.add_argument("--cost-length", type=int, default=4000, help="history of the cost rows (4k, off the cuts)")
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds before the remaining steps are skipped")
    parser.add_argument("--out", type=Path, help="write the JSON here after every step")
    args = parser.parse_args()
    args.chunk = default_chunk((), args.device)
    dtype = getattr(torch, args.dtype)
    run = Run(args)
    try:
        for keys in sorted({1024, *args.lengths}):
            run.step(f"kernels at {keys} keys")
            run.report["kernels"].append({"keys": keys, "backends": kernel_probe(args.device, dtype,
                                                                                 SHAPES[args.shape], keys)})
            run.save()
        for tiny_dtype in args.tiny_dtypes or [args.dtype]:
            for spec in args.tiny:
                run.step(f"{spec} in {tiny_dtype}")
                with tempfile.TemporaryDirectory() as tmp:
                    model, ids, inputs = tiny(spec, args.device, tiny_dtype)
                    found = matrix(model, ids, inputs, Path(tmp), TINY_CHUNK)
                run.report["tiny"].append({"model": spec, "dtype": tiny_dtype, "chunk": TINY_CHUNK, "paths": found})
                _print(spec, found)
                run.save()
        model = big(args.shape, args.device, dtype, max(args.lengths, default=0))
        for length in args.lengths:
            run.step(f"{args.shape} model at {length} tokens")
            ids = torch.randint(100, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
            with tempfile.TemporaryDirectory() as tmp:
                found = matrix(model, ids.to(args.device), {}, Path(tmp), args.chunk)
            run.report["big"].append({"model": args.shape, "length": length, "chunk": args.chunk, "paths": found})
            _print(f"{args.shape}@{length}", found)
            run.save()
        for chunk in args.chunks:
            run.step(f"costs at C={chunk}")
            run.report["costs"].append(costs(model, args.cost_length, chunk, args.device))
            print(json.dumps(run.report["costs"][-1]), flush=True)
            run.save()
    except Deadline as exc:
        run.report["incomplete"] = str(exc)
    run.save()
    verdict = run.report["summary"]
    print(json.dumps(verdict))
    return 0 if verdict["bitwise_all"] and run.report["incomplete"] is None else 1


def _print(name: str, found: dict) -> None:
    print(f"{name:20} " + ", ".join(f"{k}: {'=' if v['bitwise'] else 'DIFFERS'}" for k, v in found.items()),
          flush=True)


def _median(device: str, call, repeats: int = 5) -> float:
    """Median milliseconds of ``repeats`` calls after one warm-up call (allocator, kernel selection, caches)."""
    call()
    times = []
    for _ in range(repeats):
        begin = _now(device)
        call()
        times.append((_now(device) - begin) * 1000)
    return round(statistics.median(times), 2)


def _now(device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def _with(context, call):
    with context:
        return call()




def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return device


if __name__ == "__main__":
    sys.exit(main())
