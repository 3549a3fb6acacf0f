"""Prefix store benchmark on the real Gemma-3-270M, CPU, fp32; ratios measured side by side.

* TTFT of a request whose 1,024-token prefix is in the store (a fresh Session, as a new
  worker would have) vs the same request with no store, for the folder and Redis backends;
* the cost of a miss (key chain + lookups) relative to the prefill it precedes;
* store throughput (MB/s and ops/s) with 4 processes writing and reading real entries.

Starts its own ``redis-server`` on loopback. Writes ``bench/results/store.json``.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from common import median_time, write_results
from kvstate import PrefixStore, Session
from kvstate.protocols import PrefixQuery
from kvstate.testing import load_default_model


def start_redis(folder: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", folder],
                            stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def ttft(model, prefix, request, location: str, repeats: int) -> dict:
    Session(model, store=PrefixStore(location)).generate(prefix, max_new_tokens=1, do_sample=False)  # populate

    def with_store():
        s = Session(model, store=PrefixStore(location))
        s.generate(request, max_new_tokens=1, do_sample=False)
        assert s.last_plan.reused == prefix.shape[1], s.last_plan

    def without():
        Session(model).generate(request, max_new_tokens=1, do_sample=False)

    a, b = median_time(without, repeats), median_time(with_store, repeats)
    return {"no_store_s": a, "store_hit_s": b, "ratio": a / b}


def miss_cost(model, request, location: str, repeats: int) -> dict:
    store = PrefixStore(location, namespace="never-written")
    session = Session(model)
    last = request.shape[1] - 1
    query = PrefixQuery(session.fingerprint, request)
    lookup = median_time(lambda: store.lookup(query, longer_than=0, at_most=last), repeats)
    prefill = median_time(lambda: Session(model).generate(request, max_new_tokens=1, do_sample=False), repeats)
    return {"lookup_s": lookup, "prefill_s": prefill, "overhead_pct": 100 * lookup / prefill}


CLIENT = r"""
import sys, time
from kvstate.store import PrefixStore
store, data, n, me = PrefixStore(sys.argv[1]), open(sys.argv[2], "rb").read(), int(sys.argv[3]), sys.argv[4]
start = time.perf_counter()
for i in range(n):
    store.backend.put(f"bench-{me}-{i}", data, None)
    assert store.backend.get(f"bench-{me}-{i}") == data
print(time.perf_counter() - start)
"""


def throughput(location: str, entry: Path, ops: int) -> dict:
    """Each client times its own loop (not its imports); the slowest client bounds the wall time."""
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, location, str(entry), str(ops), str(k)],
                              stdout=subprocess.PIPE, text=True) for k in range(4)]
    wall = max(float(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs)
    moved = 4 * ops * 2 * entry.stat().st_size  # every op pair writes and reads one entry
    return {"processes": 4, "ops": 4 * ops * 2, "entry_mb": entry.stat().st_size / 1e6, "wall_s": wall,
            "mb_per_s": moved / 1e6 / wall, "ops_per_s": 4 * ops * 2 / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ops", type=int, default=6)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model, tokenizer = load_default_model()
    text = " ".join(f"Clause {i}: the tenant keeps the premises clean and returns key {i % 13}." for i in range(400))
    prefix = tokenizer(text, return_tensors="pt").input_ids[:, : args.prefix_tokens]
    request = torch.cat([prefix, tokenizer(" Summarise clause 7:", add_special_tokens=False,
                                           return_tensors="pt").input_ids], 1)
    with tempfile.TemporaryDirectory() as tmp:
        redis_proc, redis_url = start_redis(tmp)
        try:
            folder = str(Path(tmp) / "store")
            result = {"model": "gemma3-270m (fp32, sdpa)", "prefix_tokens": prefix.shape[1],
                      "request_tokens": request.shape[1],
                      "ttft": {"folder": ttft(model, prefix, request, folder, args.repeats),
                               "redis": ttft(model, prefix, request, redis_url, args.repeats)},
                      "miss": miss_cost(model, request, folder, args.repeats)}
            entry = Path(tmp) / "entry.kvs"
            key_file = next((Path(folder) / "entries").glob("*/*.kvs"))
            entry.write_bytes(key_file.read_bytes())
            result["throughput"] = {"folder": throughput(folder, entry, args.ops),
                                    "redis": throughput(redis_url, entry, args.ops)}
        finally:
            redis_proc.terminate()
    write_results("store", result)


if __name__ == "__main__":
    main()
