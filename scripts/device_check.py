"""The bitwise cold = warm matrix on one device and dtype, as one prepared script (issue 23).

For each model and attention backend, a chat is continued along every warm path, and each
answer (token ids and every step's logits) must be ``torch.equal`` to a cold run: a new
``Session`` on the whole history. The warm paths: the next turn of the same session (after
decoded tokens), a fork that diverges inside the answer, a truncation, a state file loaded
into a fresh ``Session``, and a prefix-store hit. The models: the default Gemma-3-270M (when
its extra is installed) and a tiny Qwen3-VL whose history holds a video.

    python scripts/device_check.py --device cuda --dtype bfloat16 --out bench/results/device_check.json
    python scripts/device_check.py --device cpu --models tiny:llama tiny:qwen3_vl   # what the suite runs

Backends: ``sdpa``, plus ``flash_attention_2`` where the ``flash_attn`` package is installed.
It writes JSON with the commit, versions and device, and exits 1 if any path differs. Bounded:
about a minute per model and backend on a GPU, a few seconds for the tiny models on a CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

C = 16  # canonical chunk: small enough that the short histories here resume from several cuts
N = 8


def load(spec: str, device: str, dtype: str, attn: str):
    """``(model, history ids [1, L], media inputs)`` for a spec."""
    from kvstate.models import load_model
    from kvstate.models.tiny import tiny_prompt

    if spec == "tiny:qwen3_vl":
        model = load_model(spec, attn, progress=False, dtype=dtype, device=device)[0]
        span, inputs = _video(model)
        ids = torch.cat([tiny_prompt(9), span, tiny_prompt(30, seed=3)], 1).to(model.device)
        return model, ids, {k: v.to(model.device) for k, v in inputs.items()}
    model, tokenizer = load_model(spec, attn, progress=False, dtype=dtype, device=device)
    if tokenizer is None:
        return model, tiny_prompt(45).to(model.device), {}
    text = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. From the top he could see "
            "the whole bay: the fishing boats returning and the gulls circling the harbour. One night he")
    return model, tokenizer(text, return_tensors="pt").input_ids.to(model.device), {}


def _video(model):
    from kvstate.selfcheck import adapter_for

    span, inputs = adapter_for(model).synthetic_video(model)
    return span, inputs


def run(session, ids: torch.Tensor, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    out = session.generate(ids, max_new_tokens=N, do_sample=False, return_dict_in_generate=True, output_logits=True,
                           **inputs)
    return out.sequences, torch.cat(out.logits)


def paths(model, ids: torch.Tensor, inputs: dict, folder: Path) -> dict[str, dict[str, object]]:
    """Every warm path against its cold run: ``{path: {bitwise, max_abs, reused}}``."""
    from kvstate import PrefixStore, Session

    def cold(history):
        return run(Session(model, canonical_chunk=C), history, inputs)

    def compare(name, warm, history, session):
        reference = cold(history)
        same = torch.equal(warm[0], reference[0]) and torch.equal(warm[1], reference[1])
        gap = (warm[1].float() - reference[1].float()).abs().max().item() if warm[1].shape == reference[1].shape \
            else float("inf")
        out[name] = {"bitwise": same, "max_abs": gap, "reused": session.last_plan.reused}

    out: dict[str, dict[str, object]] = {}
    store = PrefixStore(folder / "store", chunk_tokens=C)
    s = Session(model, canonical_chunk=C, store=store)
    first = run(s, ids, inputs)
    extra = ids[:, 1:9]  # more text from the same vocabulary
    turn2 = torch.cat([ids, first[0], extra], 1)
    fork = s.fork()
    s.save(folder / "turn1.kvs")
    compare("next turn", run(s, turn2, inputs), turn2, s)
    branch = torch.cat([ids, first[0][:, :2], extra.flip(1)], 1)
    compare("fork", run(fork, branch, inputs), branch, fork)
    loaded = Session.load(folder / "turn1.kvs", model)
    compare("state file", run(loaded, turn2, inputs), turn2, loaded)
    hit = Session(model, canonical_chunk=C, store=store)
    compare("prefix store", run(hit, turn2, inputs), turn2, hit)
    back = s.fork()
    cut = ids.shape[1] - 5
    if not back.state.rollback_limit(cut):
        back.truncate(cut)
        shorter = torch.cat([ids[:, :cut], extra], 1)
        compare("truncate", run(back, shorter, inputs), shorter, back)
    return out


def backends() -> list[str]:
    return ["sdpa", *(["flash_attention_2"] if importlib.util.find_spec("flash_attn") else [])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cpu or mps (default cuda)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--models", nargs="+", default=["default", "tiny:qwen3_vl"])
    parser.add_argument("--out", type=Path, help="write the JSON here (default: print only)")
    args = parser.parse_args()
    import transformers

    import kvstate

    results, ok, began = [], True, time.perf_counter()
    for spec in args.models:
        for attn in backends():
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    model, ids, inputs = load(spec, args.device, args.dtype, attn)
                    found = paths(model, ids, inputs, Path(tmp))
                except Exception as exc:
                    found = {"error": {"bitwise": False, "message": f"{type(exc).__name__}: {exc}"[:300]}}
            ok &= all(v["bitwise"] for v in found.values())
            results.append({"model": spec, "attention": attn, "paths": found})
            print(f"{spec:16} {attn:18} " + ", ".join(f"{k}: {'=' if v['bitwise'] else 'DIFFERS'}"
                                                       for k, v in found.items()), flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    report = {"ok": ok, "device": args.device, "device_name": _device_name(args.device), "dtype": args.dtype,
              "canonical_chunk": C, "new_tokens": N, "seconds": round(time.perf_counter() - began, 1),
              "commit": commit, "kvstate": kvstate.__version__, "torch": torch.__version__,
              "transformers": transformers.__version__, "results": results}
    text = json.dumps(report, indent=2)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print("all warm paths bitwise equal to the cold run" if ok else "MISMATCH: a warm path differs")
    return 0 if ok else 1


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return device


if __name__ == "__main__":
    sys.exit(main())
