"""``kvstate verify --against URL``'s options and command (the main CLI only hands them over)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .run import Options
from .scenarios import NAMES

HELP = ("check an OpenAI-compatible server's cache: each scenario sends the same request warm and cold and "
        "compares the answers greedily, --new-tokens tokens each (exit 0 consistent, 1 divergence, 2 usage error, "
        "3 inconclusive: no hit seen); "
        "docs/against.md")
LOCAL_ONLY = ("inject", "backends", "prompt", "prompt_file", "list", "quick")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, found {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 3600], found {value:g}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, found {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, found {value:g}")
    return value


def _scenarios(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown scenario {unknown or text!r}; pick from {', '.join(NAMES)}")
    return names


def add_options(parser: argparse.ArgumentParser, positive: Any) -> None:
    """The ``--against`` group of ``kvstate verify``."""
    g = parser.add_argument_group("checking a server (--against URL)", HELP)
    g.add_argument("--against", metavar="URL", help="base URL of the server to check (http://host:port or .../v1); "
                   "only the URLs given are contacted")
    g.add_argument("--cold", metavar="URL", help="the same engine and model with caching off: the cold reference "
                   "(recommended; else the server's cache-reset route, else each request's first occurrence)")
    g.add_argument("--served-model", metavar="NAME", help="the model id to request (default: the first of /v1/models)")
    g.add_argument("--api-key", metavar="K", help="sent as 'Authorization: Bearer K' to both servers")
    g.add_argument("--timeout", type=_seconds, default=60.0, metavar="S", help="seconds per request (default 60)")
    g.add_argument("--time-limit", type=_seconds, default=480.0, metavar="S",
                   help="start no probe after S seconds; what is left is inconclusive (default 480: with one "
                   "--timeout more, a run ends within 10 minutes)")
    g.add_argument("--max-requests", type=positive, default=400, metavar="N", help="requests in all (default 400)")
    g.add_argument("--clients", type=positive, default=4, metavar="N", help="concurrent clients (default 4, max 16)")
    g.add_argument("--rounds", type=positive, default=2, metavar="N", help="concurrent rounds (default 2)")
    g.add_argument("--long-chars", type=positive, default=6000, metavar="N",
                   help="characters of the long prompt (default 6000)")
    g.add_argument("--scenarios", type=_scenarios, default=NAMES, metavar="A,B",
                   help=f"the scenarios to run (default all: {', '.join(NAMES)})")
    g.add_argument("--restart-cmd", metavar="CMD", help="shell command that restarts the server (the restart "
                   "scenario: a persistent tier must serve the same answers)")
    g.add_argument("--restart-wait", type=_seconds, default=120.0, metavar="S",
                   help="seconds to wait for the command and the server's return (default 120)")
    g.add_argument("--logprob-tolerance", type=_fraction, default=1e-3, metavar="X",
                   help="logprob drift allowed above the cold floor when the servers return logprobs (default "
                   "1e-3; bf16 engines whose warm path is not bitwise need about 0.1)")
    g.add_argument("--floor-repeats", type=positive, default=2, metavar="N",
                   help="extra cold sends of one request that measure the floor (default 2)")
    g.add_argument("--no-reset", action="store_true", help="never call a cache-reset route")


def command(args: argparse.Namespace, user_error: type[Exception], save_target: Any) -> int:
    """Run ``--against`` from parsed ``args``; prints the table (or JSON) and returns the exit code."""
    from .run import run_against

    local = [f"--{n.replace('_', '-')}" for n in LOCAL_ONLY if getattr(args, n, None)]
    if local or args.model != "default":
        raise user_error(f"{', '.join(local) or '--model'} appl{'y' if len(local) > 1 else 'ies'} to the local "
                         "matrix, not to --against", fix="drop it")
    if args.clients > 16:
        raise user_error(f"--clients is at most 16, found {args.clients}", fix="pass --clients 16 or fewer")
    markdown = None if args.markdown in (None, "-") else save_target(Path(args.markdown))
    options = Options(args.against, cold_url=args.cold, api_key=args.api_key, model=args.served_model,
                      timeout=args.timeout, time_limit=args.time_limit, max_requests=args.max_requests,
                      max_tokens=args.new_tokens, clients=args.clients, rounds=args.rounds,
                      long_chars=args.long_chars, restart_cmd=args.restart_cmd, restart_wait=args.restart_wait,
                      logprob_tolerance=args.logprob_tolerance, floor_repeats=args.floor_repeats,
                      use_reset=not args.no_reset, scenarios=args.scenarios)
    report = run_against(options, progress=lambda text: print(f"[against] {text}", file=sys.stderr))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.table())
    if args.markdown:
        text = report.markdown()
        sys.stdout.write(text) if markdown is None else markdown.write_text(text)
    return report.exit_code
