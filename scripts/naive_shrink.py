"""Which causal-LM types a *naive* shrink builds (the baseline of the coverage goal), for the coverage table.

The naive shrink is the library defaults of ``AutoConfig.for_model(model_type)`` with only the
top-level sizes changed, where the config has them: 2 layers, hidden 64, vocabulary 128,
intermediate 128, 4 heads of 16 (2 key-value heads, 1 for multi-query configs). Nested configs,
special token ids, MoE, MLA and per-layer lists are left alone. A type counts if the model builds
and runs ``generate()`` with a cache on CPU. This approximates the issue's measurement (131 of
196 on transformers 5.24); the issue did not record its script. ``scripts/coverage.py`` reports
how many of these types pass.

Run: ``python scripts/naive_shrink.py [--out bench/results/naive_shrink.json] [--jobs 2]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHECK = r"""
import sys, warnings, logging, torch
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING); torch.set_num_threads(1)
from transformers import AutoConfig, AutoModelForCausalLM
t = sys.argv[1]
base = AutoConfig.for_model(t)
changes = {"num_hidden_layers": 2, "hidden_size": 64, "vocab_size": 128, "intermediate_size": 128,
           "num_attention_heads": 4, "head_dim": 16,
           "num_key_value_heads": 1 if getattr(base, "num_key_value_heads", None) == 1 else 2}
config = AutoConfig.for_model(t, **{k: v for k, v in changes.items() if getattr(base, k, None) is not None})
model = AutoModelForCausalLM.from_config(config).eval()
ids = torch.randint(4, 100, (1, 8))
model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, use_cache=True)
"""


def check(model_type: str) -> tuple[str, str]:
    try:
        run = subprocess.run([sys.executable, "-c", CHECK, model_type], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return model_type, "error: timeout"
    if run.returncode == 0:
        return model_type, "ok"
    lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
    return model_type, "error: " + (lines[-1] if lines else f"exit {run.returncode}")[:200]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/naive_shrink.json")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    with ThreadPoolExecutor(args.jobs) as pool:
        results = dict(pool.map(check, types))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from common import environment

    Path(args.out).write_text(json.dumps({"env": environment(), "results": results}, indent=1, sort_keys=True) + "\n")
    ok = sum(v == "ok" for v in results.values())
    print(f"naive shrink: {ok} of {len(types)} build and generate")


if __name__ == "__main__":
    main()
