"""``run_against``: send every scenario's probes warm and cold, judge each pair, diagnose, report.

The cold reference, strongest first: a second server with caching off (``--cold URL``);
the same server right after its cache-reset route; else each request's first
occurrence (weakest: the first send primes the cache with the very prompt, so every
warm request becomes a full hit). Comparison is greedy text first; where both servers
return logprobs, the chosen tokens and the logprob drift, against the floor measured by
repeating a cold request. A warm request with no reported hit never passes: it is
inconclusive. The run is bounded by a request count and a wall-clock limit.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ...errors import AgainstError
from .client import Call, Client, Reply
from .diagnose import diagnose
from .report import Floor, ProbeResult, Report, ScenarioResult, judge
from .scenarios import FILLER, NAMES, SCENARIOS, SYSTEM, Context, Probe, Scenario, groups

MODES = {
    "cold-server": "a second server with caching off (--cold); the control probes check that both agree without a "
                   "cache",
    "reset": "the same server right after {route}; the reference's own hit count is checked, so a reset that "
             "misses a tier shows",
    "first-occurrence": "each request's first occurrence (no --cold, no reset route): that send primes the cache "
                        "with the very prompt, so every warm request is a full hit and faults of partial hits show "
                        "only where they break it; no logprob floor. Run with --cold for the full matrix",
}


@dataclass(frozen=True)
class Options:
    """``kvstate verify --against``'s options (see its ``--help``)."""

    url: str
    cold_url: str | None = None
    api_key: str | None = None
    model: str | None = None
    timeout: float = 60.0
    time_limit: float = 480.0
    max_requests: int = 400
    max_tokens: int = 16
    clients: int = 4
    rounds: int = 2
    long_chars: int = 6000
    restart_cmd: str | None = None
    restart_wait: float = 120.0
    logprob_tolerance: float = 1e-3
    floor_repeats: int = 2
    use_reset: bool = True
    scenarios: tuple[str, ...] = NAMES
    key_lengths: tuple[int, ...] = (16, 32, 64, 256)


def run_against(options: Options, progress: Callable[[str], None] | None = None) -> Report:
    """Run the scenarios of ``options`` against its server; the report holds verdicts and diagnosis."""
    runner = _Runner(options, progress or (lambda _: None))
    return runner.run()


class _Runner:
    def __init__(self, options: Options, progress: Callable[[str], None]) -> None:
        unknown = [s for s in options.scenarios if s not in NAMES]
        if unknown:
            raise AgainstError(f"unknown scenario {unknown}", expected=", ".join(NAMES), found=unknown)
        self.options, self.say = options, progress
        self.warm = Client(options.url, options.api_key, options.timeout)
        self.cold = None if options.cold_url is None else Client(options.cold_url, options.api_key, options.timeout)
        self.started = time.monotonic()
        self.sent: set[str] = set()  # the warm requests since the last reset (a primer already sent is not resent)
        self.floor = Floor()

    def run(self) -> Report:
        opts = self.options
        self.warm.model = _pick_model(self.warm, opts.model)
        if self.cold is not None:
            self.cold.model = _pick_model(self.cold, opts.model or self.warm.model, fallback=True)
            mode, route = "cold-server", None
        else:
            route = self.warm.find_reset() if opts.use_reset else None
            mode = "reset" if route else "first-occurrence"
        self.mode = mode
        ctx = self._context()
        self.say(f"cold reference: {mode}; logprobs {'on' if self.warm.logprobs else 'off'}")
        results = [self._scenario(s, ctx) for s in SCENARIOS if s.name in opts.scenarios]
        return Report(url=self.warm.root, cold=MODES[mode].format(route=route), mode=mode, model=self.warm.model,
                      logprobs=self.warm.logprobs, floor=self.floor, tolerance=opts.logprob_tolerance,
                      requests=self.warm.sent + (self.cold.sent if self.cold else 0),
                      seconds=time.monotonic() - self.started, scenarios=results, findings=diagnose(results, mode),
                      calibration=_calibration_text(ctx))

    # ----- set-up ---------------------------------------------------------------------------------------
    def _context(self) -> Context:
        """Which fields the servers take (logprobs, completions) and where a divergence falls, in tokens."""
        opts = self.options
        ctx = Context(secrets.token_hex(4), opts.max_tokens, clients=opts.clients, rounds=opts.rounds,
                      long_chars=opts.long_chars, restart=opts.restart_cmd is not None,
                      key_lengths=opts.key_lengths)
        servers = [self.warm] + ([self.cold] if self.cold else [])
        for server in servers:
            ctx = self._capabilities(server, ctx)
        both = all(s.logprobs for s in servers)
        for server in servers:
            server.logprobs = both
        return self._calibrate(ctx)

    def _capabilities(self, server: Client, ctx: Context) -> Context:
        """Does ``server`` take logprobs, and a system message? A refusal (4xx) turns each off in turn."""
        server.logprobs = True
        reply = server.send(ctx.chat(0, "Say hello."))
        for fallback in ("logprobs", "system"):
            if not (reply.error and reply.status in (400, 404, 415, 422)):
                break
            if fallback == "logprobs":
                server.logprobs = False
            else:
                ctx = replace(ctx, system_role=False)
            reply = server.send(ctx.chat(0, "Say hello."))
        if reply.error:
            raise AgainstError(f"{server.root} did not answer a chat request: {reply.error}",
                               fix="check --served-model and --api-key")
        server.logprobs = server.logprobs and reply.logprobs is not None
        return ctx

    def _calibrate(self, ctx: Context) -> Context:
        """Tokens before the first filler word, and per filler word, from two completions' prompt_tokens."""
        server = self.cold or self.warm
        head = ctx.header(199 if self.mode == "first-occurrence" else 200) + SYSTEM + "\n\n"
        short = server.send(Call(prompt=head, max_tokens=1))
        long = server.send(Call(prompt=head + FILLER * 32, max_tokens=1))
        if self.mode == "reset":
            self.warm.reset()
        if short.error or long.error or short.prompt_tokens is None or long.prompt_tokens is None:
            return replace(ctx, completions=not (short.error and short.status in (400, 404, 405, 422)))
        per = (long.prompt_tokens - short.prompt_tokens) / 32
        return replace(ctx, start_tokens=short.prompt_tokens, filler_tokens=per)

    # ----- scenarios ------------------------------------------------------------------------------------
    def _scenario(self, scenario: Scenario, ctx: Context) -> ScenarioResult:
        reason = scenario.skip(ctx)
        if reason is not None:
            return ScenarioResult(scenario.name, scenario.title, skipped=reason)
        self.say(f"scenario {scenario.name}")
        self.sent.clear()
        probes: list[ProbeResult] = []
        refused = self._refused(scenario.check(ctx)) if scenario.check else None
        if refused:
            return ScenarioResult(scenario.name, scenario.title, skipped=refused)
        for group, answer in groups(scenario.plan(ctx)):
            over = self._over_limit()
            if over:
                return ScenarioResult(scenario.name, scenario.title, probes=probes, cut=over)
            pairs = self._group(group)
            answer([warm for _, warm in pairs])
            full = self.mode == "first-occurrence"  # there, the first send primed the very prompt
            probes += [judge(p, cold, warm, self.floor, self.options.logprob_tolerance, full=p.full or full)
                       for p, (cold, warm) in zip(group, pairs, strict=True)]
        return ScenarioResult(scenario.name, scenario.title, probes=probes)

    def _refused(self, call: Call) -> str | None:
        """Why the servers refuse ``call`` (an image on a text-only server), or None."""
        for server in [self.warm] + ([self.cold] if self.cold else []):
            reply = server.send(call)
            if reply.error and reply.status in (400, 404, 415, 422, 501):
                return f"{'the cold server' if server is self.cold else 'the server'} refused it: {reply.error}"
        return None

    def _over_limit(self) -> str | None:
        sent = self.warm.sent + (self.cold.sent if self.cold else 0)
        if sent >= self.options.max_requests:
            return f"stopped at --max-requests {self.options.max_requests}"
        if time.monotonic() - self.started > self.options.time_limit:
            return f"stopped at --time-limit {self.options.time_limit:g}s"
        return None

    def _group(self, group: tuple[Probe, ...]) -> list[tuple[Reply, Reply]]:
        """Cold replies first (sequential), then the primers, then the warm requests (concurrent for a group)."""
        colds = [self._cold(p, first=i == 0) for i, p in enumerate(group)]
        if self.mode == "reset":
            self._reset()
        for probe in group:
            for primer in probe.primers:
                self._warm(primer)
        if any(p.restart for p in group):
            self._restart()
        if len(group) == 1:
            return [(colds[0], self._warm(group[0].call, again=True))]
        barrier = threading.Barrier(len(group))

        def send(call: Call) -> Reply:
            with contextlib.suppress(threading.BrokenBarrierError):  # a late client still sends
                barrier.wait(timeout=self.options.timeout)
            return self._warm(call, again=True)
        with ThreadPoolExecutor(max_workers=len(group)) as pool:
            warms = list(pool.map(send, [p.call for p in group]))
        return list(zip(colds, warms, strict=True))

    def _cold(self, probe: Probe, first: bool) -> Reply:
        repeats = self.options.floor_repeats if first and not self.floor.samples and self.mode != "first-occurrence" \
            and probe.full else 0
        replies = []
        for _ in range(1 + repeats):
            if self.cold is not None:
                replies.append(self.cold.send(probe.reference))
            else:
                if self.mode == "reset":
                    self._reset()
                replies.append(self._warm(probe.reference))
        if repeats:
            self.floor = Floor.measure(replies)
        return replies[0]

    def _warm(self, call: Call, again: bool = False) -> Reply:
        key = json.dumps(call.body(self.warm.model, False), sort_keys=True)
        if key in self.sent and not again:
            return Reply()
        self.sent.add(key)
        return self.warm.send(call)

    def _reset(self) -> None:
        self.sent.clear()
        if not self.warm.reset():
            raise AgainstError(f"{self.warm.root}: the cache reset ({self.warm.reset_route}) stopped answering",
                               fix="pass --cold URL, a second server with caching off")

    def _restart(self) -> None:
        """Run ``--restart-cmd`` and wait until the server answers ``/v1/models`` again."""
        opts = self.options
        self.say("restarting the server")
        try:
            subprocess.run(opts.restart_cmd, shell=True, check=True, timeout=opts.restart_wait)
        except (subprocess.SubprocessError, OSError) as exc:
            raise AgainstError(f"--restart-cmd failed: {exc}", fix="check the command in a shell") from exc
        deadline = time.monotonic() + opts.restart_wait
        while time.monotonic() < deadline:
            try:
                self.warm.models()
                return
            except AgainstError:
                time.sleep(1.0)
        raise AgainstError(f"the server did not answer within {opts.restart_wait:g}s of --restart-cmd",
                           fix="raise --restart-wait, or make the command wait for the server")


def _pick_model(client: Client, wanted: str | None, fallback: bool = False) -> str:
    """``wanted`` if the server lists it (or lists nothing), else its only model where ``fallback``."""
    served = client.models()
    if wanted is None and served:
        return served[0]
    if wanted is not None and (wanted in served or not served):
        return wanted
    if fallback and len(served) == 1:
        return served[0]
    if not served:
        raise AgainstError(f"{client.root} lists no models (GET /v1/models)", fix="pass --served-model NAME")
    raise AgainstError(f"{client.root} does not serve {wanted!r}", expected=served, found=wanted,
                       fix="pass --served-model with one of the listed ids")


def _calibration_text(ctx: Context) -> str:
    if ctx.start_tokens is None or not ctx.filler_tokens:
        return "divergence positions in words (no completions route to measure tokens)"
    return (f"system prompt {ctx.start_tokens} tokens, {ctx.filler_tokens:g} tokens per filler word "
            f"(from prompt_tokens of /v1/completions)")
