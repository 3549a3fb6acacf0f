"""Core benchmark: kvstate against the fair plain-transformers baseline, side by side in one run.

* **TTFT of a new turn** (1, 8 and 64 tokens) after a 1,024- and a 4,096-token history,
  Gemma-3-270M, fp32, CPU:
  - kvstate from memory: a fork of the session that holds the history;
  - kvstate from file: ``Session.load`` + ``generate`` (the load is timed);
  - plain, fair baseline: the ``DynamicCache`` of the history, continued correctly
    (full ids, full mask; copied outside the timing, since generate mutates it);
  - plain, re-prefill of the whole conversation.
* **fork**: ``Session.fork()`` against the cheapest correct plain copy (new cache layers
  that share the tensors: transformers concatenates, it never writes them in place;
  checked in the run) and against ``copy.deepcopy``.
* **decode**: per-token time of ``Session.generate`` against ``model.generate`` continuing
  the same history, on dense (a random llama of Gemma-3-270M's size), sliding (Gemma
  past its window), compressed (Gemma's full layers at 50%, against a plain cache of the
  same slot count) and stepwise (a random Mamba) states. Per token is
  ``(time(1 + K new) - time(1 new)) / K``, so prefill and per-call costs cancel.

Writes ``bench/results/core.json``. Run: ``python bench/bench_core.py [--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MambaConfig

from common import times, write_results
from kvstate import Session
from kvstate._compat.core import CACHE_KWARG
from kvstate.compress import KNorm, PerLayerBudget
from kvstate.testing import load_default_model

# The longest-prefix schedule (reuse every processed slot) by default, so a rerun compares the code like for like;
# the canonical schedule's own cost is bench_canonical.py's.
SCHEDULE = [0]


def text_ids(tokenizer, n: int) -> torch.Tensor:
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog near river {i % 17}." for i in range(n))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :n]
    assert ids.shape[1] == n
    return ids


def plain_cache(model, ids: torch.Tensor):
    """The cache a plain prefill of ``ids`` leaves."""
    with torch.no_grad():
        return getattr(model(ids, use_cache=True), CACHE_KWARG)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# ----- TTFT -----------------------------------------------------------------------------------------------
def bench_ttft(model, ids: torch.Tensor, history: int, turns: tuple[int, ...], repeats: int, folder: Path):
    base = Session(model, canonical_chunk=SCHEDULE[0])
    base.extend(ids[:, :history])
    path = folder / f"history-{history}.kvs"
    base.save(path)
    cache = plain_cache(model, ids[:, :history])
    rows = []
    for k in turns:
        full = ids[:, :history + k]
        methods = ttft_methods(model, full, base, path, cache)
        firsts = {name: fn(setup() if setup else None) for name, (fn, setup) in methods.items()}
        agree = len({int(out[0, -1]) for out in firsts.values()}) == 1
        samples = {name: [] for name in methods}
        for _ in range(repeats):  # interleaved, so drift hits every method alike
            for name, (fn, setup) in methods.items():
                samples[name] += times(fn, 1, setup or (lambda: None))
        row = {"history": history, "turn": k, "first_tokens_agree": agree,
               **{f"{name}_s": median(v) for name, v in samples.items()}}
        row["kvstate_vs_plain_cache"] = row["plain_cache_s"] / row["kvstate_memory_s"]
        row["kvstate_vs_reprefill"] = row["plain_reprefill_s"] / row["kvstate_memory_s"]
        row["file_vs_reprefill"] = row["plain_reprefill_s"] / row["kvstate_file_s"]
        print(row, flush=True)
        rows.append(row)
    return rows


def ttft_methods(model, full: torch.Tensor, base: Session, path: Path, cache) -> dict:
    """name -> (run(setup value), setup or None) for one conversation ``full`` ``[1, L]``."""
    ones = torch.ones_like(full)
    return {
        "kvstate_memory": (lambda s: s.generate(full, max_new_tokens=1, do_sample=False), base.fork),
        "kvstate_file": (lambda _: Session.load(path, model, canonical_chunk=SCHEDULE[0]).generate(
            full, max_new_tokens=1, do_sample=False), None),
        "plain_cache": (lambda c: model.generate(full, attention_mask=ones, max_new_tokens=1, do_sample=False,
                                                 **{CACHE_KWARG: c}), lambda: copy.deepcopy(cache)),
        "plain_reprefill": (lambda _: model.generate(full, attention_mask=ones, max_new_tokens=1, do_sample=False),
                            None),
    }


# ----- fork -------------------------------------------------------------------------------------------------
def shared_copy(cache):
    """The cheapest correct plain copy: new layer objects holding the same tensors."""
    twin = copy.copy(cache)
    twin.layers = [copy.copy(layer) for layer in cache.layers]
    return twin


def bench_fork(model, ids: torch.Tensor, repeats: int):
    cache = plain_cache(model, ids)
    session = Session(model, canonical_chunk=SCHEDULE[0])
    session.extend(ids)
    # the shared copy is correct: continuing the original does not change what the copy continues with
    more, other = ids[:, :4], ids[:, 4:8]
    expected = model(more, **{CACHE_KWARG: copy.deepcopy(cache)}, use_cache=True).logits
    twin = shared_copy(cache)
    model(other, **{CACHE_KWARG: cache}, use_cache=True)
    verified = torch.equal(model(more, **{CACHE_KWARG: twin}, use_cache=True).logits, expected)
    cache = plain_cache(model, ids)
    n = repeats * 200
    result = {"tokens": ids.shape[1], "shared_copy_verified": verified,
              "kvstate_fork_s": median(times(session.fork, n)),
              "plain_shared_copy_s": median(times(lambda: shared_copy(cache), n)),
              "plain_deepcopy_s": median(times(lambda: copy.deepcopy(cache), repeats * 3)),
              "state_bytes": session.state.nbytes}
    result["vs_shared_copy"] = result["plain_shared_copy_s"] / result["kvstate_fork_s"]
    result["vs_deepcopy"] = result["plain_deepcopy_s"] / result["kvstate_fork_s"]
    print(result, flush=True)
    return result


# ----- decode -----------------------------------------------------------------------------------------------
def decode_case(name: str, model, history: torch.Tensor, steps: int, repeats: int, *, compress=None,
                plain_history: torch.Tensor | None = None, suffix_only: bool = False):
    """Per-token decode time of kvstate and of plain generate continuing the same history."""
    base = Session(model, canonical_chunk=SCHEDULE[0])
    base.extend(history[:, :-1])
    if compress is not None:
        base.compress(compress(base.state))
    plain_ids = history if plain_history is None else plain_history
    cache = plain_cache(model, plain_ids[:, :-1])
    ones = torch.ones_like(plain_ids)

    def kvstate(n):
        return lambda s: s.generate(history, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    def plain(n):
        ids = plain_ids[:, -1:] if suffix_only else plain_ids  # recurrent caches take only the new token
        mask = {} if suffix_only else {"attention_mask": ones}
        return lambda c: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **mask,
                                        **{CACHE_KWARG: c})

    setups = {"kvstate": base.fork, "plain": lambda: copy.deepcopy(cache)}
    runs = {"kvstate": kvstate, "plain": plain}
    samples = {(who, n): [] for who in runs for n in (1, 1 + steps)}
    for who in runs:  # warm-up, and the token check
        runs[who](1 + steps)(setups[who]())
    for _ in range(repeats):
        for (who, n), out in samples.items():
            out += times(runs[who](n), 1, setups[who])
    per_token = {who: (median(samples[(who, 1 + steps)]) - median(samples[(who, 1)])) / steps for who in runs}
    row = {"state": name, "history": history.shape[1], "steps": steps,
           "kvstate_ms_per_token": 1000 * per_token["kvstate"], "plain_ms_per_token": 1000 * per_token["plain"],
           "overhead_pct": 100 * (per_token["kvstate"] - per_token["plain"]) / per_token["plain"]}
    if plain_history is None:
        a = kvstate(1 + steps)(base.fork())
        b = plain(1 + steps)(copy.deepcopy(cache))[:, -(1 + steps):]
        row["tokens_agree"] = torch.equal(a, b)
    print(row, flush=True)
    return row


def random_model(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def bench_decode(gemma, ids: torch.Tensor, history: int, steps: int, repeats: int, quick: bool):
    dense = random_model(LlamaConfig(
        hidden_size=640, intermediate_size=2048, num_hidden_layers=4 if quick else 18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, vocab_size=262144, tie_word_embeddings=True))
    mamba = random_model(MambaConfig(hidden_size=768, num_hidden_layers=2 if quick else 24, state_size=16,
                                     vocab_size=50280, use_mambapy=False))

    def full_layers_half(state):  # Gemma's full-attention layers at 50%; sliding layers keep their window
        return PerLayerBudget(0.5, policy=KNorm(), ratios=tuple(0.5 if x.kind == "full_attention" else 0.0
                                                              for x in state.layers))

    h = ids[:, :history]
    return [
        decode_case("dense (llama, random weights)", dense, h, steps, repeats),
        decode_case("sliding (Gemma-3-270M past its window)", gemma, h, steps, repeats),
        decode_case("compressed (Gemma-3-270M, full layers 50%)", gemma, h, steps, repeats,
                    compress=full_layers_half, plain_history=ids[:, :history // 2 + 1]),
        decode_case("stepwise (Mamba, random weights)", mamba, ids[:, :history // 4] % 50280, steps, repeats,
                    suffix_only=True),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the script")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-repeats", type=int, default=7, help="decode differences are small: more repeats")
    parser.add_argument("--canonical-chunk", type=int, default=0, help="the sessions' schedule (default 0: off)")
    parser.add_argument("--out", default="core", help="results name under bench/results/")
    args = parser.parse_args()
    SCHEDULE[0] = args.canonical_chunk
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    histories, turns = ((128, 256), (1, 8)) if args.quick else ((1024, 4096), (1, 8, 64))
    ids = text_ids(tokenizer, max(histories) + max(turns))
    with tempfile.TemporaryDirectory() as folder:
        ttft = [row for h in histories for row in bench_ttft(model, ids, h, turns, args.repeats, Path(folder))]
    result = {
        "model": "gemma3-270m (fp32, sdpa), CPU",
        "canonical_chunk": args.canonical_chunk,
        "ttft": ttft,
        "fork": bench_fork(model, ids[:, :histories[0]], args.repeats),
        "decode": bench_decode(model, ids, 256 if args.quick else 1024, 8 if args.quick else 32,
                               1 if args.quick else args.decode_repeats, args.quick),
    }
    if args.quick:  # a check of the script, not a result
        print(result)
    else:
        write_results(args.out, result)


if __name__ == "__main__":
    main()
