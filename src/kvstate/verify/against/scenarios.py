"""The scenarios of ``verify --against``: what users report, as cold-versus-warm probes.

A ``Probe`` is one request sent warm (after its ``primers`` filled the cache) and cold
(to the reference); a scenario yields groups of probes (a group of several runs its warm
requests concurrently). Every probe starts with its own header (``Context.header``), so no
probe can hit another's entries, and a run's prompts never meet an earlier run's: a hit
comes only from the primers the probe names. Scenarios are generators: the runner sends
back each group's warm replies, which the multi-turn chat needs (the server's own answer
is the next turn's history, as in a real chat). Nothing here talks to a server.
"""

from __future__ import annotations

import base64
import struct
import zlib
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from typing import Any

from .client import Call, Reply

SYSTEM = (
    "You are the duty officer of a small harbour on a windy northern coast. You answer questions from visiting "
    "sailors, fishermen and tourists about tides, weather, moorings, the lighthouse, the ferry timetable and the "
    "history of the town. Keep every answer to one or two short sentences in plain words, without lists, tables "
    "or headings. If a question asks for something dangerous, such as sailing out in a storm warning or mooring "
    "in the closed eastern basin, say clearly that it is not allowed and give the safe alternative. The harbour "
    "has forty visitor berths on the western pontoon, a fuel dock open from seven in the morning to eight in the "
    "evening, a slipway that dries out two hours either side of low water, and a harbour office above the "
    "chandlery. The lighthouse on the point was built in 1871, shows two white flashes every ten seconds and can "
    "be visited on Sundays in summer. The ferry to the island leaves at nine, twelve and four, and does not run "
    "when the wind is above force seven. Never invent facts that are not given here; when you do not know, say "
    "that the harbour office can help and give its opening hours, eight to six every day except public holidays."
)
QUESTIONS = ("When does the first ferry leave?", "Can I visit the lighthouse on a Tuesday?",
             "Where can I buy diesel late in the evening?", "Is the slipway usable at low water?",
             "How many visitor berths are there?", "Who built the harbour office?",
             "May I moor in the eastern basin tonight?", "What do the lighthouse flashes look like?")
FILLER = " a"  # one short word per step: the shared lead that places a divergence
FULL, PARTIAL = True, False


@dataclass(frozen=True)
class Probe:
    """One request, warm and cold. ``full``: the very same prompt was primed (a full hit);
    ``position``: where the prompt leaves the primed one, in tokens, when known."""

    name: str
    call: Call
    primers: tuple[Call, ...] = ()
    full: bool = PARTIAL
    cold_call: Call | None = None  # the reference request when it differs (streaming: the whole answer)
    restart: bool = False  # run --restart-cmd between the primers and the warm request
    position: str = ""
    control: bool = False  # nothing to hit: warm and cold must agree without a cache (the servers' own match)

    @property
    def reference(self) -> Call:
        return self.cold_call or self.call


@dataclass(frozen=True)
class Context:
    """What the scenarios are built from: the run's nonce, bounds and what the server takes."""

    nonce: str
    max_tokens: int = 16
    completions: bool = True  # the server answers /v1/completions
    clients: int = 4
    rounds: int = 2
    long_chars: int = 6000
    restart: bool = False
    key_lengths: tuple[int, ...] = (16, 32, 64, 256)
    start_tokens: int | None = None  # tokens before the first filler word (measured), completions only
    filler_tokens: float | None = None  # tokens per filler word (measured)
    system_role: bool = True  # the server takes a system message

    def header(self, tag: int) -> str:
        """A fixed-width line no other probe (or run) starts with, so each probe's cache entries are its own:
        the tag comes first, so two probes share at most the template's opening and a character or two."""
        return f"[{tag:03d}.{self.nonce}]\n"

    def chat(self, tag: int, user: Any, *history: dict[str, Any], system: str = SYSTEM) -> Call:
        """A chat request: the header and system prompt as a system message, or, where the server refuses that
        role (``system_role``), at the head of the first user message."""
        lead = self.header(tag) + system
        turns = [*history, {"role": "user", "content": user}]
        if self.system_role:
            return Call(messages=({"role": "system", "content": lead}, *turns), max_tokens=self.max_tokens)
        first = turns[0]["content"]
        first = lead + "\n\n" + first if isinstance(first, str) else [{"type": "text", "text": lead + "\n\n"}, *first]
        return Call(messages=({**turns[0], "content": first}, *turns[1:]), max_tokens=self.max_tokens)


Group = tuple[Probe, ...]
Plan = Generator[Group, "list[Reply]", None]


def repeat(ctx: Context) -> Plan:
    """An identical request, twice: the hit covers the whole prompt (LMCache#4463, vllm#40896)."""
    for i, question in enumerate(QUESTIONS[:2]):
        call = ctx.chat(100 + i, question)
        yield (Probe(f"repeat {i + 1}", call, (call,), FULL),)


def shared_prefix(ctx: Context) -> Plan:
    """One primed prompt; others that leave it just before, at and after each key length (block, hash chunk,
    page): a key that covers too little serves the primed ending (a stale or colliding key, sglang#34683)."""
    steps = divergence_steps(ctx)
    longest = max(steps) + 8
    for tag, (step, where) in enumerate(steps.items(), start=200):
        lead = FILLER * step
        if ctx.completions:
            head = ctx.header(tag) + SYSTEM + "\n\n"
            primer = Call(prompt=head + FILLER * longest + "\nQ: " + QUESTIONS[6] + "\nA:", max_tokens=ctx.max_tokens)
            call = Call(prompt=head + lead + "\nQ: " + QUESTIONS[0] + "\nA:", max_tokens=ctx.max_tokens)
        else:
            primer = ctx.chat(tag, FILLER * longest + "\n" + QUESTIONS[6])
            call = ctx.chat(tag, lead + "\n" + QUESTIONS[0])
        yield (Probe(f"ending after {step} words", call, (primer,), PARTIAL, position=where),)


def divergence_steps(ctx: Context) -> dict[int, str]:
    """Filler words before the ending -> where the divergence falls, straddling every key length."""
    per, start = ctx.filler_tokens, ctx.start_tokens
    if not per or start is None:  # not measured: words, not tokens
        return {0: "right after the system prompt", **{k + d: f"after ~{k + d} user words" for k in ctx.key_lengths
                                                         for d in (-1, 1)}}
    steps = {0: f"at token {start}"}
    for key in ctx.key_lengths:
        edge = (start // key + 1) * key
        for target in (edge - 1, edge, edge + 1):
            step = max(0, round((target - start) / per))
            at = start + round(step * per)
            steps.setdefault(step, f"at token {at} ({_relative(at, key)})")
    return steps


def _relative(at: int, key: int) -> str:
    offset = at % key
    if offset == 0:
        return f"on a {key}-token boundary"
    if offset <= key // 2:
        return f"{offset} past a {key}-token boundary"
    return f"{key - offset} before a {key}-token boundary"


def multi_turn(ctx: Context) -> Plan:
    """A chat whose history grows by the server's own answers: each turn's rendered history must continue
    the last one's tokens, the template and the token at the turn boundary included."""
    history: list[dict[str, Any]] = []
    previous: Call | None = None
    for turn, question in enumerate(QUESTIONS[2:5]):
        call = ctx.chat(300, question, *history)
        if previous is None:
            replies = yield (Probe("turn 1 (nothing to hit)", call, control=True),)
        else:
            replies = yield (Probe(f"turn {turn + 1}", call, (previous,), PARTIAL),)
        answer = replies[0].text if replies else ""
        history += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        previous = call


def edited_turn(ctx: Context) -> Plan:
    """A chat whose earlier turn was edited: the divergence lies inside the cached prefix, so only what
    precedes the edit may be reused."""
    edits = (("user", QUESTIONS[0], QUESTIONS[0].replace("first", "last")),
             ("assistant", "The first ferry leaves at nine.", "The first ferry leaves at noon."))
    for i, (role, before, after) in enumerate(edits):
        call = _edited(ctx, 400 + i, role, after)
        yield (Probe(f"{role} turn edited", call, (_edited(ctx, 400 + i, role, before),), PARTIAL),)


def _edited(ctx: Context, tag: int, role: str, text: str) -> Call:
    user = text if role == "user" else QUESTIONS[0]
    answer = text if role == "assistant" else "The first ferry leaves at nine."
    return ctx.chat(tag, QUESTIONS[1], {"role": "user", "content": user}, {"role": "assistant", "content": answer})


def image_check(ctx: Context) -> Call:
    """A request of its own (no probe shares its header) that tells whether the server takes images."""
    return ctx.chat(509, [{"type": "image_url", "image_url": {"url": png_url(9)}}, {"type": "text", "text": "Hi."}])


def image(ctx: Context) -> Plan:
    """The same text with the same image (a full hit) and with a different image (must not hit past the
    image): an image hash that is missing from the key, or too short, serves the other image (LMCache#4086)."""
    def ask(tag: int, seed: int) -> Call:
        parts = [{"type": "image_url", "image_url": {"url": png_url(seed)}},
                 {"type": "text", "text": "What colour is this flag?"}]
        return ctx.chat(tag, parts)
    yield (Probe("same image", ask(500, 1), (ask(500, 1),), FULL),)
    yield (Probe("different image, same text", ask(501, 2), (ask(501, 1),), PARTIAL),)


def long_prompt(ctx: Context) -> Plan:
    """A prompt across sliding windows, pages and block sizes: a repeat, and a different late ending."""
    same = ctx.chat(600, _facts(ctx) + "\nWhich boat is the longest?")
    yield (Probe("long, repeated", same, (same,), FULL),)
    other = ctx.chat(601, _facts(ctx) + "\nWhich boat leaves first?")
    yield (Probe("long, different ending", other, (ctx.chat(601, _facts(ctx) + "\nWhich boat is blue?"),), PARTIAL),)


def long_check(ctx: Context) -> Call:
    """The long prompt on its own: a server whose context is shorter refuses it, and the scenario is skipped."""
    return replace(ctx.chat(609, _facts(ctx) + "\nWhich boat is red?"), max_tokens=1)


def _facts(ctx: Context) -> str:
    return "".join(f"Berth {i}: the {_COLOURS[i % 7]} boat there is {10 + i * 7 % 23} metres long and leaves "
                   f"on day {i % 28 + 1}. " for i in range(ctx.long_chars // 80 + 1))[:ctx.long_chars]


_COLOURS = ("red", "blue", "green", "white", "black", "yellow", "grey")


def streaming(ctx: Context) -> Plan:
    """A streamed request against the same request answered whole (the streamed path reads the cache too)."""
    call = ctx.chat(700, QUESTIONS[3])
    yield (Probe("streamed repeat", replace(call, stream=True), (call,), FULL, cold_call=call),)
    other = ctx.chat(701, QUESTIONS[4])
    primer = ctx.chat(701, QUESTIONS[5])
    yield (Probe("streamed, different ending", replace(other, stream=True), (primer,), PARTIAL, cold_call=other),)


def concurrent(ctx: Context) -> Plan:
    """Several clients at once on one primed prefix, each with its own ending: a slot, page or buffer shared
    across requests answers one client with another's K/V (LMCache#4385)."""
    for round_ in range(ctx.rounds):
        tag = 800 + round_
        primer = ctx.chat(tag, QUESTIONS[7])
        yield tuple(Probe(f"round {round_ + 1}, client {c + 1}", ctx.chat(tag, QUESTIONS[c % 7]), (primer,), PARTIAL)
                    for c in range(ctx.clients))


def restart(ctx: Context) -> Plan:
    """The same request after ``--restart-cmd``: a persistent tier (disk, host memory, a store) serves it."""
    call = ctx.chat(900, QUESTIONS[1])
    yield (Probe("after restart", call, (call,), FULL, restart=True),)


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    plan: Callable[[Context], Plan]
    check: Callable[[Context], Call] | None = None  # a request the server may refuse: then skipped, with why
    skip: Callable[[Context], str | None] = lambda ctx: None


SCENARIOS = (
    Scenario("repeat", "identical repeat", repeat),
    Scenario("shared-prefix", "shared prefix, different endings", shared_prefix),
    Scenario("multi-turn", "multi-turn chat", multi_turn),
    Scenario("edited-turn", "edited earlier turn", edited_turn),
    Scenario("image", "same text, different image", image, check=image_check),
    Scenario("long", "long prompt", long_prompt, check=long_check),
    Scenario("streaming", "streaming vs whole", streaming),
    Scenario("concurrent", "concurrent clients", concurrent),
    Scenario("restart", "after a restart", restart,
             skip=lambda ctx: None if ctx.restart else "no --restart-cmd given"),
)
NAMES = tuple(s.name for s in SCENARIOS)


def groups(plan: Plan) -> Iterator[tuple[Group, Callable[[list[Reply]], None]]]:
    """Drive a plan: yields each group with the function that hands its warm replies back."""
    replies: list[Reply] = []
    try:
        group = next(plan)
        while True:
            box: list[list[Reply]] = []
            yield group, box.append
            replies = box[0] if box else []
            group = plan.send(replies)
    except StopIteration:
        return


def png_url(seed: int, size: int = 32) -> str:
    """A ``data:`` URL of a ``size``x``size`` PNG, three stripes whose colours depend on ``seed``
    (written with zlib: no imaging library needed)."""
    colours = [((seed * 97 + k * 61) % 256, (seed * 53 + k * 131) % 256, (seed * 29 + k * 17) % 256) for k in range(3)]
    rows = b"".join(b"\x00" + bytes(c for x in range(size) for c in colours[x * 3 // size]) for _ in range(size))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()
