"""The ``kvstate`` command: a thin layer over the library (parsing and printing only)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .verify.faults import FAULTS

EPILOG = """examples:
  kvstate verify                        # the embedded Gemma-3-270M, default prompt
  kvstate verify --model tiny:gemma3_text
  kvstate verify --prompt-file chat.txt --new-tokens 32 --json
  kvstate verify --backends eager,sdpa --markdown report.md
  kvstate verify --inject drop-mask     # plant a known bug: see how the diagnosis reads
  kvstate verify --list                 # supported model families
  kvstate prefill --prompt-file doc.txt --out doc.kvs     # prompt caching from the shell
  kvstate generate --state doc.kvs --prompt " Summary:"   # starts answering at once
  kvstate inspect doc.kvs [--json]
  kvstate generate --store ~/.cache/kvstate/store --prompt "..."   # repeated prompts get faster
  kvstate store stats --store redis://127.0.0.1:6379/0
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstate", description="Explicit, portable, exact generation state for transformers.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="the generation-equivalence control matrix, with diagnosis",
                       description="Continue one prompt through every kvstate path (and, for contrast, the "
                       "usual plain-transformers ways) and compare first-step logits and greedy tokens with a "
                       "fresh full-prompt run. Prints which branch of the resume contract a failure points to. "
                       "Exits 1 when a kvstate row fails; plain-transformers rows never fail the run.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    v.add_argument("--model", default="default",
                   help="'default' (embedded Gemma-3-270M), 'tiny:<model_type>' (random tiny "
                   "config), or a local folder for from_pretrained")
    v.add_argument("--prompt", help="prompt text (default: a built-in paragraph)")
    v.add_argument("--prompt-file", type=Path, help="read the prompt text from this file")
    v.add_argument("--new-tokens", type=int, default=16, help="greedy tokens to compare (default 16)")
    v.add_argument("--backends", help="comma-separated attention backends to run, e.g. eager,sdpa "
                   "(default: the model's own)")
    v.add_argument("--quick", action="store_true", help="fewer tokens, skip the slowest rows (< 1 min)")
    v.add_argument("--json", action="store_true", help="print JSON (schema: docs/verify.schema.json)")
    v.add_argument("--markdown", nargs="?", const="-", metavar="FILE",
                   help="write a Markdown report to FILE (or stdout), ready to paste into an issue")
    v.add_argument("--inject", choices=FAULTS, help="plant one known bug in the kvstate rows (self-test)")
    v.add_argument("--list", action="store_true", help="list supported model types and exit")
    i = sub.add_parser("inspect", help="describe a state file (header only)")
    i.add_argument("file", type=Path)
    i.add_argument("--json", action="store_true", help="JSON (schema: docs/inspect.schema.json)")
    p = sub.add_parser("prefill", help="process a prompt once and save the state to a file")
    p.add_argument("--model", default="default", help="'default' or a local folder")
    p.add_argument("--prompt-file", type=Path, required=True, help="text file with the prompt")
    p.add_argument("--out", type=Path, required=True, help="state file to write")
    p.add_argument("--chunk-size", type=int, default=256, help="tokens per forward (progress granularity)")
    g = sub.add_parser("generate", help="continue a saved state with more text; prints the answer")
    g.add_argument("--model", default="default", help="'default' or a local folder")
    g.add_argument("--state", type=Path, help="state file from `kvstate prefill`")
    g.add_argument("--store", help="prefix store (folder or redis://...): reuse and save prefixes")
    g.add_argument("--prompt", default="", help="text appended after the saved tokens (or the whole prompt)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--save", type=Path, help="also save the continued conversation here")
    st = sub.add_parser("store", help="inspect or prune a prefix store")
    st.add_argument("action", choices=["stats", "ls", "prune"])
    st.add_argument("--store", required=True, help="folder or redis://host:port/db")
    st.add_argument("--max-bytes", type=int, help="prune: evict least recently used entries down to this size")
    st.add_argument("--json", action="store_true")
    return parser


def _load(spec: str, attn: str | None = None) -> tuple[Any, Any]:
    from .testing.models import load_model

    return load_model(spec, attn)


def _prompt_ids(args: argparse.Namespace, tokenizer: Any) -> Any:
    from .testing.tiny import tiny_prompt
    from .verify import DEFAULT_PROMPT

    text = args.prompt_file.read_text() if args.prompt_file else args.prompt
    if tokenizer is None:
        if text:
            raise SystemExit("kvstate: tiny models have no tokenizer; omit --prompt/--prompt-file")
        return tiny_prompt(40)
    return tokenizer(text or DEFAULT_PROMPT, return_tensors="pt").input_ids


def _verify(args: argparse.Namespace) -> int:
    from . import supported_model_types
    from .verify import verify

    if args.list:
        print("\n".join(supported_model_types()))
        return 0
    reports = []
    for backend in (args.backends.split(",") if args.backends else [None]):
        model, tokenizer = _load(args.model, backend)
        new_tokens = 4 if args.quick and args.new_tokens == 16 else args.new_tokens
        reports.append(verify(
            model, _prompt_ids(args, tokenizer), new_tokens=new_tokens, name=args.model,
            fresh=lambda backend=backend: _load(args.model, backend)[0], spec=args.model,
            fault=args.inject, quick=args.quick, progress=True))
    ok = all(r.ok for r in reports)
    if args.json:
        print(json.dumps({"schema_version": 1, "ok": ok, "reports": [r.to_dict() for r in reports]}, indent=2))
    else:
        print("\n\n".join(r.table(colour=sys.stdout.isatty()) for r in reports))
    if args.markdown:
        text = "\n".join(r.markdown() for r in reports)
        sys.stdout.write(text) if args.markdown == "-" else Path(args.markdown).write_text(text)
    return 0 if ok else 1


def _inspect(args: argparse.Namespace) -> int:
    from .io import inspect_state

    info = inspect_state(args.file)
    print(json.dumps(info, indent=2) if args.json else _inspect_table(info))
    return 0


def _inspect_table(info: dict[str, Any]) -> str:
    model = info["model"] or {}
    lines = [
        f"state file   {info['path']}",
        f"format       {info['format']} v{info['version']}, storage {info['storage']}, kv {info['kv_dtype']}",
        f"model        {model.get('model_type')} {model.get('architectures')}, dtype {model.get('dtype')}, "
        f"config {str(model.get('config_hash'))[:12]}, weights {str(model.get('weights_digest'))[:12]}",
        f"tokens       {info['tokens_seen']} seen, batch {info['batch_size']}, "
        f"next position {info['next_position']}, last logits {'yes' if info['has_last_logits'] else 'no'}",
        f"bytes        {info['file_bytes']:,} file, {info['tensor_bytes']:,} tensors",
        f"extras       {info['extras'] or '(none)'}",
        f"metadata     {info['metadata'] or '(none)'}",
        f"{'layer':>5}  {'kind':<18} {'seen':>6} {'slots':>6} {'window':>6}  {'positions':<13} {'bytes':>10}",
    ]
    for layer in info["layers"]:
        pos = "-" if layer["positions"] is None else f"{layer['positions'][0]}..{layer['positions'][1]}"
        lines.append(f"{layer['index']:>5}  {layer['kind']:<18} {layer['tokens_seen']:>6} {layer['slots']:>6} "
                     f"{layer['window'] if layer['window'] is not None else '-':>6}  {pos:<13} {layer['bytes']:>10,}")
    return "\n".join(lines)


def _prefill(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .session import Session

    model, tokenizer = _load(args.model)
    ids = tokenizer(args.prompt_file.read_text(), return_tensors="pt").input_ids
    session = Session(model, tokenizer=tokenizer, chunk_size=args.chunk_size)
    with tqdm(total=ids.shape[1], desc="prefill", unit="tok", file=sys.stderr) as bar:
        for start in range(0, ids.shape[1], args.chunk_size):
            session.extend(ids[:, start:start + args.chunk_size])
            bar.update(min(args.chunk_size, ids.shape[1] - start))
    size = session.save(args.out, metadata={"prompt_file": str(args.prompt_file)})
    print(f"saved {ids.shape[1]} tokens to {args.out} ({size:,} bytes)", file=sys.stderr)
    return 0


def _generate(args: argparse.Namespace) -> int:
    import time

    import torch
    from transformers import TextStreamer

    from .session import Session
    from .store import PrefixStore

    if (args.state is None) == (args.store is None):
        raise SystemExit("kvstate generate: pass exactly one of --state FILE or --store LOCATION")
    model, tokenizer = _load(args.model)
    start = time.perf_counter()
    if args.state is not None:
        session = Session.load(args.state, model, tokenizer=tokenizer)
        new = tokenizer(args.prompt, add_special_tokens=False, return_tensors="pt").input_ids
        history = torch.cat([session.tokens, new], 1)
    else:
        session = Session(model, tokenizer=tokenizer, store=PrefixStore(args.store))
        history = tokenizer(args.prompt, return_tensors="pt").input_ids
    session.generate(history, max_new_tokens=args.max_new_tokens, do_sample=False,
                     streamer=TextStreamer(tokenizer, skip_prompt=True))
    plan = session.last_plan
    print(f"[kvstate] reused {plan.reused} tokens from {args.state or args.store}, fed {plan.fed}; "
          f"{time.perf_counter() - start:.1f}s after load", file=sys.stderr)
    if args.save:
        session.save(args.save)
    return 0


def _store(args: argparse.Namespace) -> int:
    from .store import PrefixStore

    store = PrefixStore(args.store)
    if args.action == "prune":
        if args.max_bytes is None:
            raise SystemExit("kvstate store prune: --max-bytes is required")
        print(f"evicted {store.prune(args.max_bytes)} entries; {store.stats()['bytes']:,} bytes remain")
        return 0
    data = store.stats() if args.action == "stats" else store.ls()
    if args.json:
        print(json.dumps(data, indent=2))
    elif args.action == "stats":
        print("\n".join(f"{k:<32} {v}" for k, v in data.items()))
    else:
        print("\n".join(f"{e['key'][:16]}  {e['bytes']:>12,}  {time_text(e['last_access'])}" for e in data))
    return 0


def time_text(stamp: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(stamp).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"verify": _verify, "inspect": _inspect, "prefill": _prefill, "generate": _generate, "store": _store}
    from .errors import KVStateError

    try:
        return commands[args.command](args)
    except KVStateError as exc:
        print(f"kvstate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
