"""State-file benchmark on the real Gemma-3-270M, CPU, fp32, at 1,024, 2,048 and 4,096 tokens.

Side by side, in one run (contenders interleaved round by round, medians):
* save / load throughput (MB of retained K/V per second) and file size for
  - ``Session.save`` / ``Session.load`` (atomic write + fsync; every byte read and its checksum
    verified, header validated, model checks), ``load_state`` (no model checks) and
    ``container.read`` (header checks, read and hash only: no ``State`` is built),
  - ``torch.save`` / ``torch.load`` of the transformers ``DynamicCache`` (pickle),
  - ``safetensors.torch.save_file`` / ``load_file`` of the same retained tensors (physical reference),
    with fsync for saves, with every byte read (``clone``) for loads, and with every byte read and
    hashed (XXH3-64, the check kvstate makes) for the same integrity;
* time to first token of a conversation saved one token short: ``Session.load`` + generate,
  a pickled ``DynamicCache`` loaded + generate (the plain file baseline), and a re-prefill;
* compact storage: bytes saved vs max |Δlogit| and greedy agreement over 32 tokens.

Writes ``bench/results/state_io.json``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import xxhash
from safetensors.torch import load_file, save_file

from common import RESULTS, interleaved, median_time, write_results
from kvstate import Session, load_state
from kvstate._compat.core import CACHE_KWARG
from kvstate.io import container, schema
from kvstate.testing import load_default_model


def prompt_ids(tokenizer, n: int) -> torch.Tensor:
    text = " ".join(f"Entry {i}: the committee reviewed budget line {i % 29} and approved it." for i in range(n))
    return tokenizer(text, return_tensors="pt").input_ids[:, :n]


def io_row(model, ids, folder: Path, rounds: int) -> dict:
    session = Session(model)
    session.extend(ids)
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
    _, tensors = schema.encode(session.state)
    kv_mb = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.startswith("layers.")) / 1e6
    ours, pickled, raw = folder / "s.kvs", folder / "cache.pt", folder / "raw.safetensors"

    def save_fsync():  # the physical reference with the same durability as ours
        save_file(tensors, raw)
        fd = os.open(raw, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def load_touch():  # load_file maps lazily; clone() reads every byte, as a real load must
        return {k: v.clone() for k, v in load_file(raw).items()}

    def load_touch_verify():  # the same, plus the integrity check ours makes (XXH3-64 of every tensor)
        loaded = load_touch()
        return [xxhash.xxh3_64_hexdigest(memoryview(t.reshape(-1).view(torch.uint8).numpy())) for t in loaded.values()]

    times = interleaved({
        "kvstate_save": lambda: session.save(ours), "torch_save": lambda: torch.save(cache, pickled),
        "safetensors_save": lambda: save_file(tensors, raw), "safetensors_save_fsync": save_fsync,
    }, max(rounds // 3, 5))
    times |= interleaved({
        "kvstate_load": lambda: Session.load(ours, model), "kvstate_load_state": lambda: load_state(ours),
        "kvstate_read_verified": lambda: container.read(ours),  # the file part: header checks, read, hash
        "torch_load": lambda: torch.load(pickled, weights_only=False), "safetensors_load": lambda: load_file(raw),
        "safetensors_load_touch": load_touch, "safetensors_load_touch_verify": load_touch_verify,
    }, rounds)
    return {
        "tokens": ids.shape[1], "retained_kv_mb": kv_mb,
        "file_mb": {"kvstate": ours.stat().st_size / 1e6, "torch_save": pickled.stat().st_size / 1e6,
                    "safetensors": raw.stat().st_size / 1e6},
        "ms": {k: 1e3 * v for k, v in times.items()},
        "mb_per_s": {k: kv_mb / v for k, v in times.items()},
        "kvstate_vs_safetensors": {
            "save_both_fsync": times["safetensors_save_fsync"] / times["kvstate_save"],
            "save_vs_no_fsync": times["safetensors_save"] / times["kvstate_save"],
            "load_both_read_all": times["safetensors_load_touch"] / times["kvstate_load"],
            "load_state_both_read_all": times["safetensors_load_touch"] / times["kvstate_load_state"],
            "read_verified_both_read_all": times["safetensors_load_touch"] / times["kvstate_read_verified"],
            "load_both_read_and_verify_all": times["safetensors_load_touch_verify"] / times["kvstate_load"],
            "load_vs_lazy_map": times["safetensors_load"] / times["kvstate_load"]},
    }


def ttft_row(model, ids, folder: Path, repeats: int) -> dict:
    """A conversation saved after ``ids[:-1]`` answers its next token: every path runs a real forward."""
    Session(model).save(folder / "empty.kvs")  # warm the code path
    s = Session(model)
    s.extend(ids[:, :-1])
    s.save(folder / "p.kvs")
    with torch.no_grad():
        torch.save(getattr(model(ids[:, :-1], use_cache=True), CACHE_KWARG), folder / "cache.pt")
    ones = torch.ones_like(ids)

    def kvstate_file():
        Session.load(folder / "p.kvs", model).generate(ids, max_new_tokens=1, do_sample=False)

    def torch_file():  # the plain way: a pickled DynamicCache, continued correctly
        cache = torch.load(folder / "cache.pt", weights_only=False)
        model.generate(ids, attention_mask=ones, max_new_tokens=1, do_sample=False, **{CACHE_KWARG: cache})

    def prefill():
        model.generate(ids, attention_mask=ones, max_new_tokens=1, do_sample=False)

    a, b, c = median_time(prefill, repeats), median_time(kvstate_file, repeats), median_time(torch_file, repeats)
    return {"tokens": ids.shape[1], "prefill_s": a, "kvstate_file_s": b, "torch_file_s": c,
            "vs_prefill": a / b, "vs_torch_file": c / b}


def compact_rows(model, ids, folder: Path) -> list[dict]:
    s = Session(model)
    s.extend(ids)
    follow = ids[:, 1:9]
    ref = s.fork()
    ref_logits = ref.extend(follow)
    ref_tokens = ref.generate(torch.cat([ids, follow], 1), max_new_tokens=32, do_sample=False)
    exact = s.save(folder / "exact.kvs")
    rows = []
    for compact in ("bfloat16", "float16", "int8"):
        size = s.save(folder / f"{compact}.kvs", compact=compact)
        loaded = Session.load(folder / f"{compact}.kvs", model)
        logits = loaded.extend(follow)
        tokens = loaded.generate(torch.cat([ids, follow], 1), max_new_tokens=32, do_sample=False)
        agree = int((tokens == ref_tokens)[0].int().cumprod(0).sum())
        rows.append({"storage": compact, "bytes_saved_pct": 100 * (1 - size / exact),
                     "max_abs_dlogit": (logits - ref_logits).abs().max().item(),
                     "relative": ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item(),
                     "greedy_agree_of_32": agree})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3, help="TTFT repeats")
    parser.add_argument("--rounds", type=int, default=41, help="interleaved rounds of each load (saves: a third)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    result: dict = {"model": "gemma3-270m (fp32, sdpa)", "io": [], "ttft": [], "compact": None}
    with tempfile.TemporaryDirectory(dir=RESULTS.parent) as tmp:
        folder = Path(tmp)
        for n in args.tokens:
            ids = prompt_ids(tokenizer, n)
            result["io"].append(io_row(model, ids, folder, args.rounds))
            result["ttft"].append(ttft_row(model, ids, folder, args.repeats))
        result["compact"] = compact_rows(model, prompt_ids(tokenizer, args.tokens[0]), folder)
    write_results("state_io", result)


if __name__ == "__main__":
    main()
