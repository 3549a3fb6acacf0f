"""The speed steps of a device run (``scripts/device_run.py`` runs them, each under a hard timeout): kvstate against
plain transformers on one device, one stream, many streams, and the hardware's bound.

Built for one GPU (a Qwen3-8B shape with random weights, built on the device from its config: no download; the
weights change neither the times nor the bits), tried on the CPU at a small shape first. Measured side by side:

* **one stream**: a 300-token prompt, 32 greedy tokens: plain ``model.generate`` against ``Session.generate``, time to
  first token and decode tokens per second (``(N - 1) / (t_N - t_1)``, from two runs of 1 and N tokens);
* **streams** (16, then 8; prompts of 64-460 tokens, 32 tokens each): kvstate's ``generate_many`` with batch
  invariance (every answer checked bitwise against the same request alone), without it (the invariance tax), with
  ``static_shapes`` (the capture-ready step a CUDA graph would replay, run eagerly: its cost, and its bits checked
  against the invariant answers), and transformers' ``generate_batch`` (continuous batching; a persistent manager,
  measured on its second call);
* **the bound**: decode reads every weight once per step, so one stream cannot beat bandwidth / weight bytes; the
  bandwidth is measured here (a large device-to-device copy), and ``bandwidth_fraction`` is kvstate's one-stream
  decode rate over that bound.

``summary`` gives the speed ratios kvstate / other; a PNG of tokens per second against streams goes beside the JSON.

    python bench/bench_gpu.py --cpu-trial --budget 200 --out /tmp/speed   # the speed steps alone
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from device_check import _median, _now

N = 32
PROMPT = 300


def one_stream(model, device: str) -> dict[str, float]:
    """Plain ``generate`` and ``Session.generate`` on one 300-token prompt: TTFT (ms) and decode tokens/s."""
    from kvstate import Session

    ids = torch.randint(100, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    ids = ids.to(device)
    greedy = dict(do_sample=False, eos_token_id=None)

    def plain(n: int):
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, **greedy)

    def ours(n: int):
        return Session(model).generate(ids, max_new_tokens=n, min_new_tokens=n, **greedy)

    out = {"weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    for name, call in (("plain", plain), ("kvstate", ours)):
        first = _median(device, lambda call=call: call(1))
        whole = _median(device, lambda call=call: call(N))
        out[f"{name}_ttft_ms"] = first
        out[f"{name}_decode_tok_s"] = round((N - 1) / max((whole - first) / 1000, 1e-9), 2)
    return out


def requests(n: int, vocab: int, device: str, longest: int = 460) -> list:
    """``n`` greedy requests with prompts of 64 to ``longest`` tokens."""
    from kvstate.batch import BatchRequest

    gen = torch.Generator().manual_seed(7)
    lengths = [64 + ((longest - 64) * i) // max(n - 1, 1) for i in range(n)]
    return [BatchRequest(torch.randint(100, vocab, (length,), generator=gen).to(device), max_new_tokens=N,
                         stop_ids=()) for length in lengths]


def streams(model, n: int, device: str, longest: int = 460) -> dict[str, object]:
    """``n`` streams (prompts of 64 to ``longest`` tokens) through kvstate (invariant, then not) and transformers'
    ``generate_batch``: tokens per second, and whether each invariant answer is bitwise the same request alone."""
    from transformers import GenerationConfig

    from kvstate.batch import generate_many

    batch = requests(n, model.config.vocab_size, device, longest)
    out: dict[str, object] = {"streams": n}
    answers = {}
    for name, invariant, static in (("kvstate", True, False), ("kvstate_no_invariance", False, False),
                                    ("kvstate_static_shapes", True, True)):
        begin = _now(device)
        done = answers[name] = generate_many(model, batch, max_batch=n, invariant=invariant, static_shapes=static)
        seconds = _now(device) - begin
        out[f"{name}_tok_s"] = round(sum(len(c.tokens) for c in done) / seconds, 2)
    same = [(c.tokens, c.logprobs) for c in answers["kvstate"]]
    alone = [generate_many(model, [r], max_batch=1)[0] for r in batch]
    out["alone_equals_batched"] = [(c.tokens, c.logprobs) for c in alone] == same
    # the capture-ready step (each pool's whole capacity, one shape between growths) run eagerly: the same bits
    out["static_shapes_bitwise"] = [(c.tokens, c.logprobs) for c in answers["kvstate_static_shapes"]] == same
    config = GenerationConfig(max_new_tokens=N, min_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0)
    prompts = [r.ids.tolist() for r in batch]
    sized = _cb_sized(device, prompts)
    try:
        model.generate_batch(prompts, generation_config=config, persistent_manager=True, **sized)  # graphs, pages
        begin = _now(device)
        result = model.generate_batch(prompts, generation_config=config, persistent_manager=True, **sized)
        seconds = _now(device) - begin
        out["transformers_tok_s"] = round(sum(len(r.generated_tokens) for r in result.values()) / seconds, 2)
    except Exception as exc:  # an older transformers without continuous batching on this device
        out["transformers_error"] = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
        if callable(destroy):  # the persistent manager holds its cache pages: free them for the next row
            destroy()
    return out


def _cb_sized(device: str, prompts: list[list[int]]) -> dict[str, object]:
    """On the CPU, transformers' continuous batching sized to the job: its default sizes the page cache from
    the machine's free memory, which took 12 of the CPU trial's 20 seconds to allocate. A GPU keeps the
    default (the pages a real server would have)."""
    if device != "cpu":
        return {}
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    tokens = sum(len(p) + N for p in prompts)
    return {"continuous_batching_config": ContinuousBatchingConfig(num_blocks=tokens // 256 + len(prompts) + 1,
                                                                   max_batch_tokens=max(len(p) for p in prompts) + N)}


def bandwidth(device: str) -> float:
    """Bytes per second of a large copy on ``device`` (read + write), the memory bound a decode step meets."""
    size = (1 << 30) if device == "cuda" else (1 << 28)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = _median(device, lambda: dst.copy_(src)) / 1000
    return 2 * size / seconds


def summary(report: dict, chunk: int) -> dict[str, object]:
    """Speed ratios kvstate / other, and whether every batched answer was its alone answer bit for bit."""
    one = report["one_stream"][0] if report["one_stream"] else None
    rows = report["streams"]
    by = {r["streams"]: r for r in rows}
    most = by.get(max(by)) if by else None
    bandwidth = report["bandwidth_bytes_s"][0] if report["bandwidth_bytes_s"] else None
    bound = bandwidth / one["weight_bytes"] if one and bandwidth else None
    return {
        "one_stream_decode_vs_plain": one and round(one["kvstate_decode_tok_s"] / one["plain_decode_tok_s"], 3),
        "ttft_300_vs_plain": one and round(one["kvstate_ttft_ms"] / one["plain_ttft_ms"], 3),
        "streams16_vs_transformers": most and most.get("transformers_tok_s") and
        round(most["kvstate_tok_s"] / most["transformers_tok_s"], 3),
        "alone_equals_batched": bool(rows) and all(r.get("alone_equals_batched") for r in rows),
        "static_shapes_bitwise": bool(rows) and all(r.get("static_shapes_bitwise") for r in rows),
        "invariance_tax": most and round(1 - most["kvstate_tok_s"] / most["kvstate_no_invariance_tok_s"], 3),
        "bandwidth_fraction": bound and round(one["kvstate_decode_tok_s"] / bound, 3),
        "streams_measured": sorted(by)}


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = report["streams"]
    xs = [r["streams"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("kvstate_tok_s", "kvstate (batch invariant)"), ("kvstate_no_invariance_tok_s",
                                                                      "kvstate (no invariance)"),
                       ("transformers_tok_s", "transformers generate_batch")):
        ax.plot(xs, [r.get(key) or float("nan") for r in rows], marker="o", label=label)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{report['shape']} shape, {report['dtype']}, {report['device_name']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    import device_run

    return device_run.main(["--only", "speed", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
