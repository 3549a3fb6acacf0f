"""The exactness steps of a device run (``scripts/device_run.py`` runs them, each under a hard timeout): bitwise
cold = warm on one device at real sizes, with the slots each warm path reused, and what the canonical schedule costs.

* **kernels** (``kernels_row``): one attention call of the big shape (a 512-token chunk after 1k..16k cached keys) on
  every backend, three times each: run-to-run bitwise or not, and the time;
* **matrix** (``big_row``, ``tiny_row``): every warm path (next turn, fork, state file, prefix store, truncate)
  against a cold run (a new ``Session`` on the whole history), cold runs against each other, and the slots each
  warm path reused: a warm row that reused nothing tested nothing, and the summary says so. The tiny Qwen3-VL's
  row also compares its vision tower on kvstate's path with plain sdpa (bidirectional attention stays so);
* **costs**: the cold prefill of 4k tokens against plain ``model.generate``'s time to first token, and a 16-token
  warm turn after 4k against plain ``generate`` continuing a ``DynamicCache`` (median of 5 after a warm-up).

``summary`` is the report's verdict: ``bitwise_all`` holds only if every row is bitwise and every warm row reused
slots; ``reuse`` lists the slots reused per row.

    python scripts/device_check.py --cpu-trial --budget 200 --out /tmp/check   # the exactness steps alone
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

N = 8  # greedy tokens per run
TINY_CHUNK = 16  # the tiny histories are short: small chunks so they resume from several cuts
SHAPES = {  # the big model: Qwen3-8B's shape, and a small stand-in for the CPU trial
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=512),
}


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


def matrix(model, ids: torch.Tensor, inputs: dict, folder: Path, chunk: int, repeats: int = 2) -> dict[str, dict]:
    """Every warm path and ``repeats`` more cold runs against the cold run: ``{path: {bitwise, max_abs, reused}}``."""
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
    for i in range(2, 2 + repeats):  # the same cold run again
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


# ----- the rows a device run records ---------------------------------------------------------------------------------
def big_row(model, shape: str, length: int, chunk: int, device: str) -> dict:
    """The matrix on the big model at a random history of ``length`` tokens, at the device's chunk."""
    ids = torch.randint(100, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        found = matrix(model, ids.to(device), {}, Path(tmp), chunk, repeats=1)
    _print(f"{shape}@{length}", found)
    return {"model": shape, "length": length, "chunk": chunk, "paths": found}


def tiny_row(spec: str, device: str, dtype: str) -> dict:
    """The matrix on a tiny family; Qwen3-VL's also checks its vision tower against plain sdpa (``vision``)."""
    with tempfile.TemporaryDirectory() as tmp:
        model, ids, inputs = tiny(spec, device, dtype)
        found = matrix(model, ids, inputs, Path(tmp), TINY_CHUNK)
    _print(spec, found)
    row = {"model": spec, "dtype": dtype, "chunk": TINY_CHUNK, "paths": found}
    if "pixel_values_videos" in inputs:
        row["vision"] = vision(model, inputs)
    return row


def vision(model, inputs: dict) -> dict:
    """The video features on kvstate's path against plain sdpa's: the same bidirectional attention, so within the
    dtype's rounding (PyTorch's pick of kernel rounds differently on a GPU); a causal tower is off by far more."""
    from kvstate._compat.attention import deterministic

    pixels, grid = inputs["pixel_values_videos"], inputs["video_grid_thw"]
    tower = model.model.visual
    with torch.no_grad():
        plain = tower(pixels, grid_thw=grid).last_hidden_state.float()
        with deterministic(model):
            ours = tower(pixels, grid_thw=grid).last_hidden_state.float()
    return {"max_abs_vs_sdpa": (ours - plain).abs().max().item(), "scale": plain.abs().max().item(),
            "dtype": str(next(tower.parameters()).dtype)}


ROUNDING = {"torch.bfloat16": 2 ** -7, "torch.float16": 2 ** -10, "torch.float32": 1e-5}  # relative to the scale


def kernels_row(args: argparse.Namespace, longest: int) -> list[dict]:
    """``kernel_probe`` at 1k keys and every history length up to ``longest``."""
    dtype = getattr(torch, args.dtype)
    return [{"keys": keys, "backends": kernel_probe(args.device, dtype, SHAPES[args.shape], keys)}
            for keys in sorted({1024, *args.lengths}) if keys <= max(longest, 1024)]


def summary(report: dict, chunk: int) -> dict:
    """The verdict: every row bitwise, every warm row reusing slots (a row that reused none tested nothing)."""
    rows = report["tiny"] + report["big"]
    named = {f"{r['model']}@{r.get('length', r.get('dtype'))}": r["paths"] for r in rows}
    warm = [(name, p) for paths in named.values() for name, p in paths.items() if not name.startswith("cold run")]
    costs_at = [c for c in report["costs"] if c["chunk"] == chunk]
    visions = [r["vision"] for r in rows if "vision" in r]
    return {"bitwise_all": bool(rows) and all(p["bitwise"] for m in named.values() for p in m.values())
            and all(p["reused"] > 0 for _, p in warm),
            "repeat_bitwise": bool(rows) and all(p["bitwise"] for m in named.values() for n, p in m.items()
                                                 if n.startswith("cold run")),
            "warm_rows_without_reuse": [f"{m}: {n}" for m, paths in named.items() for n, p in paths.items()
                                        if not n.startswith("cold run") and p["reused"] == 0],
            "reuse": {m: {n: p["reused"] for n, p in paths.items() if not n.startswith("cold run")}
                      for m, paths in named.items()},
            "max_history": max((r["length"] for r in report["big"] if all(p["bitwise"] and (p["reused"] > 0 or
                                n.startswith("cold run")) for n, p in r["paths"].items())), default=0),
            "vision_within_rounding": all(v["max_abs_vs_sdpa"] <= ROUNDING[v["dtype"]] * v["scale"] for v in visions)
            if visions else None,
            "cold_prefill_vs_plain": costs_at[0]["cold_vs_plain"] if costs_at else None,
            "warm_turn_vs_plain_cache": costs_at[0]["warm_vs_plain_cache"] if costs_at else None,
            "chunk": chunk}


def main() -> int:
    import device_run

    return device_run.main(["--only", "check", *sys.argv[1:]])


def _print(name: str, found: dict) -> None:
    print(f"{name:20} " + ", ".join(f"{k}: {'=' if v['bitwise'] else 'DIFFERS'} (reused {v['reused']})"
                                    for k, v in found.items()), flush=True)


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




if __name__ == "__main__":
    sys.exit(main())
