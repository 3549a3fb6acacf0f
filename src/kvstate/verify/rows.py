"""The control matrix: every row continues one prompt and is compared with one fresh reference.

The prompt is split as the long seed does: the state holds ``prompt[:-1]`` and the
last token is the unprocessed suffix. Rows come in groups:

* cache variants (kvstate): original, rebuilt from raw K/V, saved + loaded, loaded
  into a fresh instance, loaded in another process;
* plain transformers (contrast): ``generate`` from the same cache with neither mask
  nor positions, mask only, positions only, both, and on a fresh instance;
* the kvstate path, the token boundary, and the checks of the core contract;
* model-specific rows: sliding window crossed, left-padded batch, multimodal prefix,
  divergent history.

``fault`` plants one known bug in the kvstate rows, to show how the diagnosis reads.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .._compat import attention
from ..io import save_state
from ..layers import LAYER_KINDS
from ..selfcheck import adapter_for
from ..session import Session
from ..state import State
from .report import Determinism, Floor, Row, compare, crashed

Result = tuple[torch.Tensor, torch.Tensor]  # first-step logits [B, V], greedy tokens [B, N]


@dataclass
class Matrix:
    """Inputs of one run; ``fresh`` builds a new instance with the same weights, ``spec`` names it."""

    model: Any
    ids: torch.Tensor
    n: int
    fresh: Callable[[], Any] | None = None
    spec: str | None = None
    attn: str | None = None
    fault: str | None = None
    quick: bool = False
    inputs: dict[str, Any] = field(default_factory=dict)  # media of ``ids`` (a video prefix)
    given_floor: Floor | None = None  # a media prefix cannot be split: its matrix takes the text matrix's floor
    rows: list[Row] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.adapter = adapter_for(self.model)
        media = self.adapter.plain_inputs(self.model, self.ids, self.inputs) if self.inputs else {}
        self.ref_logits, self.ref_tokens = reference(self.model, self.ids, self.n, **media)
        # a family fed one token per forward cannot run the canonical schedule (docs/exactness.md): its rows
        # are judged within the floor only, and the report says so with chunk 0
        device = next(self.model.parameters()).device.type
        self.chunk = 0 if self.adapter.caps.stepwise else canonical_chunk(self.ids.shape[1], device)
        attention.reset_counts()
        self.cold_steps = cold_steps(self.session(), self.ids, self.n, **self.inputs)
        self.cold = self.cold_steps[0][0], self.cold_steps[1]  # what every warm path must equal
        self.determinism: Determinism | None = None  # ``repeat_row``'s
        s = self.session()
        s.extend(self.ids[:, :-1], **self.inputs)
        self.prefix = s.state
        self._fresh_model: Any = None
        chunked = noise_floor(self.model, self.ids, self.n, (self.ref_logits, self.ref_tokens), self.chunk) \
            if self.given_floor is None else self.given_floor  # a media history cannot be prefilled in pieces
        chunked = replace(chunked, chunk=self.chunk)
        # a media history cannot be prefilled in pieces: the text floor, widened by the split before the last
        # token (the same-instance resume the long seed found exact with a full mask)
        self.floor = chunked if self.given_floor is None else self._with_last_split(chunked)

    def _with_last_split(self, floor: Floor) -> Floor:
        """``floor`` widened by the plain split before the last token (the prefix's cache plus that token, full
        mask)."""
        try:
            split = compare("floor", "plain", "", *plain(self.model, self.prefix, self.ids, self.n, mask=True,
                                                         positions=False), self.ref_logits, self.ref_tokens)
        except Exception:
            return floor
        if split.max_abs is None or split.max_abs <= floor.max_abs:  # type: ignore[operator]
            return floor
        return Floor(split.max_abs, split.relative, min(split.greedy_agree, floor.greedy_agree),  # type: ignore[arg-type]
                     self.n, [*floor.splits, self.ids.shape[1] - 1], self.chunk)

    def session(self, model: Any = None, **settings: Any) -> Session:
        """A Session on ``model`` (this matrix's by default) with the matrix's canonical chunk."""
        return Session(self.model if model is None else model, canonical_chunk=self.chunk, **settings)

    def cold_run(self, ids: torch.Tensor, **inputs: Any) -> Result:
        """The kvstate cold run on another history: a new Session, nothing processed."""
        return greedy(self.session(), ids, self.n, **inputs)

    def floor_of(self, ids: torch.Tensor, ref: Result, mask: torch.Tensor | None = None) -> Floor:
        """The noise floor of another (text) history, for a row that runs on it."""
        return noise_floor(self.model, ids, self.n, ref, self.chunk, mask)

    def fresh_model(self) -> Any:
        if self._fresh_model is None and self.fresh is not None:
            self._fresh_model = self.fresh()
        return self._fresh_model

    def row(self, name: str, group: str, description: str, run: Callable[[], Result],
            facts: dict[str, Any] | None = None, ref: Result | None = None, cold: Result | None = None,
            canonical: bool = True, floor: Floor | None = None) -> None:
        """Run one path; a crash is recorded as the row's result, never raised. A kvstate row on the
        canonical schedule must equal ``cold`` bitwise (the matrix's cold run when ``ref`` is its own)."""
        ref_logits, ref_tokens = ref or (self.ref_logits, self.ref_tokens)
        canonical = canonical and self.chunk > 0
        if group == "kvstate" and canonical and cold is None and ref is None:
            cold = self.cold
        try:
            logits, tokens = run()
        except Exception as exc:
            self.rows.append(crashed(name, group, description, exc, facts))
            return
        self.rows.append(compare(name, group, description, logits, tokens, ref_logits, ref_tokens, facts,
                                 cold=cold if group == "kvstate" and canonical else None, floor=floor or self.floor))


def canonical_chunk(length: int, device: str = "cpu") -> int:
    """The canonical chunk verify runs kvstate with on a ``device`` type: the session default, or for a prompt
    shorter than twice that the largest power of two <= a quarter of it (at least 4), so the resumes keep slots."""
    from ..schedule import default_chunk

    default = default_chunk((), device)
    if length >= 2 * default:
        return default
    return max(4, 1 << max((length // 4).bit_length() - 1, 0))


def noise_floor(model: Any, ids: torch.Tensor, n: int, whole: Result, chunk: int,
                mask: torch.Tensor | None = None) -> Floor:
    """Plain transformers against itself: ``whole`` (``generate`` prefilling the history in one forward)
    against ``generate`` prefilling it in chunks (``prefill_chunk_size``) of a quarter and of three quarters
    of it, and of the canonical chunk (the schedule kvstate's rows run, done by plain transformers); the
    worst of them. A family whose ``generate`` cannot chunk its prefill has no floor (0)."""
    L = ids.shape[1]
    splits, worst = [], Floor(0.0, 0.0, n, n, [], chunk)
    for split in sorted({max(1, L // 4), max(1, 3 * L // 4), *([chunk] if chunk else [])} - {L}):
        try:
            out = model.generate(ids, attention_mask=torch.ones_like(ids) if mask is None else mask, max_new_tokens=n,
                                 do_sample=False,
                                 return_dict_in_generate=True, output_logits=True, prefill_chunk_size=split)
        except Exception:
            continue
        splits.append(split)
        row = compare("floor", "plain", "", out.logits[0], out.sequences[:, L:], *whole)
        if row.max_abs >= worst.max_abs:  # type: ignore[operator]
            worst = Floor(row.max_abs, row.relative, row.greedy_agree, n, [], chunk)  # type: ignore[arg-type]
    return replace(worst, splits=splits)


def reference(model: Any, ids: torch.Tensor, n: int, **inputs: Any) -> Result:
    """A fresh full-sequence run: plain ``generate`` with an explicit full mask."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         return_dict_in_generate=True, output_logits=True, **inputs)
    return out.logits[0], out.sequences[:, ids.shape[1]:]


def cold_steps(session: Session, ids: torch.Tensor, n: int, **inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A greedy run's logits of every step ``[N, B, V]`` and its tokens ``[B, N]``."""
    out = session.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                           output_logits=True, **inputs)
    return torch.stack(out.logits), out.sequences


def repeat_row(m: Matrix) -> None:
    """The kvstate cold run again in this process, first: where two identical runs differ, the kernels are not
    run-to-run deterministic and nothing can be bitwise (``Report.determinism``, and the diagnosis says so)."""
    steps, tokens = cold_steps(m.session(), m.ids, m.n, **m.inputs)
    first, again = m.cold_steps
    same_shape = steps.shape == first.shape and tokens.shape == again.shape
    bitwise = same_shape and torch.equal(steps, first) and torch.equal(tokens, again)
    delta = (steps.float() - first.float()).abs().max().item() if steps.shape == first.shape else float("inf")
    ran = attention.counts()
    calls = ", ".join(f"{kernel} {n}" for kernel, n in sorted(ran.items()))
    what = attention.describe(m.model) + (f"; kernel calls of the two runs: {calls}" if calls else "")
    m.determinism = Determinism(bool(bitwise), float(delta), what)
    m.row("kvstate: cold run, repeated", "kvstate", "the kvstate cold run again, in the same process",
          lambda: (steps[0], tokens), {"instance": "same", "repeat": True})


def greedy(session: Session, ids: torch.Tensor, n: int, **inputs: Any) -> Result:
    out = session.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                           output_logits=True, **inputs)
    return out.logits[0], out.sequences


def plain(model: Any, state: State, ids: torch.Tensor, n: int, *, mask: bool, positions: bool,
          **inputs: Any) -> Result:
    """What users do today: the cache holding ``state`` plus only the unprocessed suffix."""
    adapter = adapter_for(model)
    cache = adapter.build_cache(model, state.layers, state.batch_size)
    suffix = ids[:, state.tokens_seen:]
    kwargs: dict[str, Any] = dict(inputs)
    if mask:
        kwargs["attention_mask"] = torch.ones_like(ids)
    if positions:
        new = adapter.chunk_positions(model, state.next_position, suffix, torch.ones_like(suffix, dtype=torch.bool),
                                      inputs)
        kwargs["position_ids"] = adapter.model_positions(new)
    out = model.generate(input_ids=suffix, max_new_tokens=n, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, **{adapter.cache_kwarg(model): cache}, **kwargs)
    return out.logits[0], out.sequences[:, suffix.shape[1]:]


def rebuild(state: State) -> State:
    """A state rebuilt from raw, cloned K/V tensors (validated when a Session adopts it)."""
    layers = tuple(LAYER_KINDS[layer.kind].from_parts(layer.meta(), {k: v.clone() for k, v in layer.tensors().items()})
                   for layer in state.layers)
    return replace(state, layers=layers)


def same_kv(a: State, b: State) -> bool:
    return all(x.tensors().keys() == y.tensors().keys() and all(torch.equal(x.tensors()[k], y.tensors()[k])
                                                                 for k in x.tensors())
               for x, y in zip(a.layers, b.layers, strict=True))


def faulty_prefix(m: Matrix) -> State:
    """The prefix state the kvstate rows start from (shifted when that fault is planted)."""
    if m.fault == "shift-positions":  # every slot's recorded position, so a resume that cuts back keeps the shift
        return replace(m.prefix, positions=m.prefix.positions + 1, next_position=m.prefix.next_position + 1)
    return m.prefix


def cache_variant_rows(m: Matrix) -> None:
    prefix = faulty_prefix(m)
    rebuilt = rebuild(prefix)
    if m.fault == "corrupt-k":  # one K slot of one layer goes wrong in the rebuild (the first: every resume keeps it)
        layer = next(x for x in rebuilt.layers if "keys" in x.tensors())
        layer.tensors()["keys"][..., 0, :] += 1.0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prefix.kvs"
        save_state(prefix, path)
        variants = [("kvstate: original state", "a new Session adopts the state",
                     lambda: m.session(state=prefix), True),
                    ("kvstate: rebuilt from raw K/V", "cloned K/V tensors, re-validated",
                     lambda: m.session(state=rebuilt), same_kv(m.prefix, rebuilt)),
                    ("kvstate: saved + loaded", "save, then Session.load in this process",
                     lambda: Session.load(path, m.model), True)]
        for name, description, make, identical in variants:
            run = (lambda make=make: greedy(make(), m.ids, m.n)) if m.fault != "drop-mask" else \
                (lambda make=make: plain(m.model, make().state, m.ids, m.n, mask=False, positions=True))
            m.row(name, "kvstate", description, run, {"instance": "same", "kv_identical": identical,
                                                      "full_mask": m.fault != "drop-mask"})
        fresh_rows(m, path)
        process_row(m, path)


def fresh_rows(m: Matrix, path: Path) -> None:
    fresh = m.fresh_model()
    if fresh is None:
        m.skipped.append("fresh-instance rows: no way to build a fresh instance was given")
        return

    m.row("kvstate: fresh instance", "kvstate", "Session.load into a new instance, same weights",
          lambda: greedy(Session.load(path, fresh), m.ids, m.n),
          {"instance": "fresh", "full_mask": True, "twin": "kvstate: saved + loaded"})
    m.adapter.reset_model(fresh)  # as freshly loaded: no model-side state
    m.row("plain: fresh instance, mask only", "plain", "the same cache moved to a new instance, full mask",
          lambda: plain(fresh, m.prefix, m.ids, m.n, mask=True, positions=False), {"instance": "fresh"})


CHILD = """
import sys, torch
from safetensors.torch import load_file, save_file
from kvstate import Session
from kvstate.models import load_model
spec, attn, folder, n, dtype, device = sys.argv[1], sys.argv[2] or None, sys.argv[3], int(sys.argv[4]), *sys.argv[5:7]
model = load_model(spec, attn, progress=False, dtype=dtype, device=device)[0]
ids = load_file(folder + "/ids.safetensors")["ids"]
out = Session.load(folder + "/prefix.kvs", model).generate(ids, max_new_tokens=n, do_sample=False,
                                                          return_dict_in_generate=True, output_logits=True)
save_file({"logits": out.logits[0].contiguous(), "tokens": out.sequences.contiguous()}, folder + "/out.safetensors")
"""


def process_row(m: Matrix, path: Path) -> None:
    if m.spec is None or m.quick:
        m.skipped.append("another-process row: " + ("--quick" if m.quick else "no model spec to load it by"))
        return
    from safetensors.torch import load_file, save_file

    def run() -> Result:
        save_file({"ids": m.ids.contiguous()}, str(path.parent / "ids.safetensors"))
        weight = next(m.model.parameters())  # the child loads the spec in the parent's dtype, on its device
        subprocess.run([sys.executable, "-c", CHILD, m.spec, m.attn or "", str(path.parent), str(m.n),
                        str(weight.dtype).removeprefix("torch."), str(weight.device)],
                       check=True, capture_output=True, timeout=600)
        out = load_file(str(path.parent / "out.safetensors"))
        return out["logits"], out["tokens"]

    m.row("kvstate: another process", "kvstate", "Session.load in a new Python process", run,
          {"instance": "fresh", "full_mask": True, "twin": "kvstate: saved + loaded"})


def plain_rows(m: Matrix) -> None:
    for name, mask, positions in (("neither", False, False), ("mask only", True, False),
                                  ("positions only", False, True), ("both", True, True)):
        m.row(f"plain: {name}", "plain", f"cache + suffix token, {name}",
              lambda mask=mask, positions=positions: plain(m.model, m.prefix, m.ids, m.n, mask=mask,
                                                          positions=positions),
              {"instance": "same", "full_mask": mask})
