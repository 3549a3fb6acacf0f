"""The ``kvstate`` command: a thin layer over the library (parsing and printing only)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EPILOG = """examples:
  kvstate verify                        # the embedded Gemma-3-270M, default prompt
  kvstate verify --model tiny:gemma3_text
  kvstate verify --prompt-file chat.txt --new-tokens 32 --json
  kvstate verify --list                 # supported model families
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstate", description="Explicit, portable, exact generation state for transformers.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="prove resume/reset/fork/truncate/chunking exact on a model",
                       description="Compare every kvstate path with a fresh full-prompt run on plain "
                       "transformers: first-step logits and greedy tokens. Exits 1 on any mismatch.",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    v.add_argument("--model", default="default",
                   help="'default' (embedded Gemma-3-270M), 'tiny:<model_type>' (random tiny "
                   "config), or a local folder for from_pretrained")
    v.add_argument("--prompt", help="prompt text (default: a built-in paragraph)")
    v.add_argument("--prompt-file", type=Path, help="read the prompt text from this file")
    v.add_argument("--new-tokens", type=int, default=16, help="greedy tokens to compare (default 16)")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.add_argument("--list", action="store_true", help="list supported model types and exit")
    return parser


def _load(spec: str) -> tuple[Any, Any]:
    """(model, tokenizer or None) for a ``--model`` value."""
    if spec == "default":
        from .default_model import load_default_model

        return load_default_model()
    if spec.startswith("tiny:"):
        from .tiny import tiny_model

        return tiny_model(spec.removeprefix("tiny:")), None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(spec, dtype="float32", local_files_only=True)
    return model.eval(), AutoTokenizer.from_pretrained(spec, local_files_only=True)


def _prompt_ids(args: argparse.Namespace, tokenizer: Any) -> Any:
    from .tiny import tiny_prompt
    from .verify import DEFAULT_PROMPT

    text = args.prompt_file.read_text() if args.prompt_file else args.prompt
    if tokenizer is None:
        if text:
            raise SystemExit("kvstate: tiny models have no tokenizer; omit --prompt/--prompt-file")
        return tiny_prompt(40)
    return tokenizer(text or DEFAULT_PROMPT, return_tensors="pt").input_ids


def _verify(args: argparse.Namespace) -> int:
    from . import supported_model_types
    from .errors import KVStateError
    from .verify import verify

    if args.list:
        print("\n".join(supported_model_types()))
        return 0
    try:
        model, tokenizer = _load(args.model)
        report = verify(model, _prompt_ids(args, tokenizer), new_tokens=args.new_tokens,
                        name=args.model, progress=sys.stderr.isatty() or not args.json)
    except KVStateError as exc:
        print(f"kvstate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.table(colour=sys.stdout.isatty()))
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "verify":
        return _verify(args)
    return 2  # unreachable: argparse requires a command


if __name__ == "__main__":
    sys.exit(main())
