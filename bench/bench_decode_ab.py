"""Per-token decode of ``Session.generate`` against plain ``model.generate``, for an A/B between two kvstate sources.

``bench_core``'s dense case (a random llama of Gemma-3-270M's size, fp32, a 1,024-token history, 32 steps, medians
of 5), printed as one JSON line. Run it once per source, alternating, with ``PYTHONPATH`` naming the source:

    for i in 1 2; do for src in /tmp/old/src src; do PYTHONPATH=$src python bench/bench_decode_ab.py; done; done

``bench/results/decode_room_ab.json`` records such a run (24298a7 against the static room).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_core
import kvstate


def main() -> None:
    dense = bench_core.random_model(LlamaConfig(
        hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, vocab_size=262144, tie_word_embeddings=True))
    ids = torch.randint(10, 262000, (1, 1024), generator=torch.Generator().manual_seed(0))
    row = bench_core.decode_case("dense", dense, ids, 32, 5)
    print(json.dumps({"source": kvstate.__file__, "kvstate_ms_per_token": row["kvstate_ms_per_token"],
                      "plain_ms_per_token": row["plain_ms_per_token"], "overhead_pct": row["overhead_pct"]}))


if __name__ == "__main__":
    main()
