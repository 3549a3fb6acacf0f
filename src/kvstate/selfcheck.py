"""Which adapter a model gets, and the self-check that earns an unregistered model its trust.

Registered families (``kvstate.adapters``) are trusted: the test suite proves them. Any
other causal decoder gets the structural adapter, but only after a short equivalence
probe on the user's own model, the first time kvstate meets its architecture (model
type plus layer layout):

1. a prefill of n random tokens in one forward, the reference (n is 16, or more: twice the
   widest window or sparse top-k plus 8, up to 64); it must be reproducible, and with the
   last token changed, every earlier slot's K/V must stay the same (causality);
2. the same split at n/3 and at 2n/3: multi-token continuations from the cache;
3. if those differ, the same continuations one token per forward;
4. a rollback: the state cropped by 4 tokens, then those 4 fed again;
5. ``generate`` from the first split against plain ``model.generate``.

The architecture is accepted as ``exact`` (2 matches), ``exact-scan`` (2 matches once a
Mamba-style selective scan starts from the cached state, ``_compat.scan``), ``stepwise`` (only
3 matches: a continuation is fed one token per forward, as transformers drops state on
multi-token chunks for some families), and with rollback only if 4 matches; otherwise it is refused
with ``UnsupportedModelError`` naming what failed (attention that is not causal, state
outside the cache, a cache the model does not fill). Matching means the project
tolerance, max |Δ| <= 1e-5 x max |reference| in fp32 (8 ulps of the dtype otherwise).

Verdicts are cached as signed JSON per architecture, transformers version and model (its
weights and in-place module state, ``kvstate.verdict_cache``), under the user cache dir
(``KVSTATE_SELFCHECK_CACHE`` overrides the folder; ``off`` disables the cache).
``kvstate verify`` remains the full proof.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from . import verdict_cache
from ._compat.core import observe_layout
from ._compat.scan import mixers
from .adapters import Adapter
from .adapters.base import registered
from .adapters.binding import Binding, bound
from .adapters.structural import StructuralAdapter, structural_caps
from .engine import Engine
from .errors import UnsupportedError, UnsupportedModelError
from .settings import Settings
from .state import State

PROBE_VERSION = 4  # bump when the probe changes, so cached verdicts are redone
# config fields bounding how far back a token attends (windows, sparse top-k): the probe goes past them
_WINDOW_FIELDS = ("sliding_window", "attention_window_size", "keep_window_size", "index_topk", "window_size",
                  "local_window_size", "attention_chunk_size")
_MODES = ("exact", "exact-scan", "stepwise", "refused")
_SETTINGS = Settings(chunk_size=64, canonical_chunk=0, max_checkpoints=4)


@dataclass(frozen=True)
class Verdict:
    """What the probe found: ``mode`` is ``exact``, ``exact-scan``, ``stepwise`` or ``refused`` (with ``reason``)."""

    mode: str
    rollback: bool
    reason: str | None
    seconds: float


def bind(model: torch.nn.Module) -> Binding:
    """The model bound to its family's adapter (``adapter_for``): the one entry every session,
    server and verify run takes to a model. It lives beside the self-check because an
    unregistered model earns its adapter by running the engine."""
    return bound(model, adapter_for(model))


def adapter_for(model: torch.nn.Module) -> Adapter:
    """The registered adapter of the model's family, else the structural one, if the self-check passes."""
    adapter = registered(model)
    if adapter is not None:
        adapter.prepare(model)
        return adapter
    base = structural_adapter(model)
    verdict = cached_verdict(model, base)
    if verdict.mode == "refused":
        raise _refusal(model, verdict.reason)
    adapter = base.with_mode(stepwise=verdict.mode == "stepwise", rollback=verdict.rollback,
                             scan=verdict.mode == "exact-scan")
    return adapter.with_kv_shapes(kv_shapes(model, adapter))


def structural_adapter(model: torch.nn.Module) -> StructuralAdapter:
    """The structural adapter before the self-check: capabilities from the signature and config, the
    cache layout from one short forward (``_compat.core.observe_layout``)."""
    try:
        caps = structural_caps(model)
    except UnsupportedError as exc:
        raise UnsupportedModelError(str(exc).split("; ")[0], found=exc.found, fix=exc.fix) from exc
    try:
        specs = observe_layout(model, _random_ids(model, 4))
    except UnsupportedError as exc:
        raise UnsupportedModelError(str(exc).split("; ")[0], found=exc.found, fix=exc.fix) from exc
    except Exception as exc:  # the model cannot run on a plain transformers cache
        raise _refusal(model, f"the probe failed: {type(exc).__name__}: {str(exc)[:200]}") from exc
    return StructuralAdapter(caps, specs)


def _refusal(model: torch.nn.Module, reason: str | None) -> UnsupportedModelError:
    model_type = getattr(model.config, "model_type", type(model).__name__)  # type: ignore[union-attr]
    return UnsupportedModelError(f"{model_type} failed kvstate's self-check", expected="an exact continuation",
                                 found=reason, fix="kvstate cannot hold this model's state exactly; "
                                 "`kvstate verify` shows the details")


def cached_verdict(model: torch.nn.Module, adapter: StructuralAdapter) -> Verdict:
    """The verdict for this model, from the signed cache (``kvstate.verdict_cache``) or from a fresh probe."""
    key = _cache_key(model, adapter)
    stored = verdict_cache.read(key) if key is not None else None
    if stored is not None:
        try:
            return _verdict(stored)
        except (ValueError, TypeError):
            pass  # signed, yet not a verdict this version reads: probe again and rewrite it
    verdict = probe(model, adapter)
    if key is not None:
        verdict_cache.write(key, asdict(verdict))
    return verdict


def _verdict(stored: dict[str, object]) -> Verdict:
    verdict = Verdict(**stored)  # type: ignore[arg-type]
    if verdict.mode not in _MODES or not isinstance(verdict.rollback, bool) or \
            not isinstance(verdict.reason, str | None):
        raise ValueError(f"not a verdict: {stored!r}")
    return verdict


def probe(model: torch.nn.Module, adapter: StructuralAdapter) -> Verdict:
    """Run the equivalence probe (see the module docstring) on ``model``."""
    start = time.perf_counter()
    try:
        mode, rollback, reason = _probe(model, adapter)
    except Exception as exc:  # any failure of the model on kvstate's path is a refusal, never an acceptance
        mode, rollback, reason = "refused", False, f"the probe failed: {type(exc).__name__}: {str(exc)[:200]}"
    return Verdict(mode, rollback, reason, round(time.perf_counter() - start, 3))


def _probe(model: torch.nn.Module, adapter: StructuralAdapter) -> tuple[str, bool, str | None]:
    ids = _random_ids(model, probe_length(model))
    n = ids.shape[1]
    chunked = Engine(bound(model, adapter.with_mode(stepwise=False, rollback=True)))
    whole = _feed(chunked, _empty(chunked), ids)
    if not _same_kv(whole, _feed(chunked, _empty(chunked), ids), n):
        return "refused", False, "two identical forwards from an empty cache disagree: state lives outside the cache"
    if not _causal(chunked, whole, ids):
        return "refused", False, "the attention is not causal: a later token changes the keys and values stored " \
                                 "for earlier ones"
    heads = [_feed(chunked, _empty(chunked), ids[:, :k]) for k in (n // 3, 2 * n // 3)]  # two split points
    engine, mode = chunked, "exact"
    if not _continues(chunked, heads, ids, whole, crash_is_mismatch=True):
        scanning = Engine(bound(model, adapter.with_mode(stepwise=False, rollback=True, scan=True)))
        if mixers(model) and _continues(scanning, heads, ids, whole, crash_is_mismatch=True):
            engine, mode = scanning, "exact-scan"  # chunks exact once the scan starts from the cache
        else:
            engine, mode = Engine(bound(model, adapter.with_mode(stepwise=True, rollback=True))), "stepwise"
    if mode == "stepwise" and not _continues(engine, heads, ids, whole):
        return "refused", False, ("continuing from the cache does not reproduce a whole forward, in chunks or "
                                  "one token at a time: the attention is not causal, or state lives outside "
                                  "the cache")
    rollback = _rolls_back(engine, whole, ids)
    if not _generates_alike(model, engine, heads[0], ids[:, :n // 3 + 3]):
        return "refused", False, "generate() from the cache disagrees with a plain model.generate()"
    return mode, rollback, None


def probe_length(model: torch.nn.Module) -> int:
    """Tokens the probe feeds: past every window or top-k the model attends through (up to 64), so that
    behaviour which only shows beyond them is probed too."""
    config = model.config.get_text_config(decoder=True)  # type: ignore[union-attr,operator]
    widths = [getattr(config, k, None) for k in _WINDOW_FIELDS]
    widest = max([w for w in widths if isinstance(w, int) and not isinstance(w, bool)], default=0)
    return min(max(16, 2 * widest + 8), 64)


def _continues(engine: Engine, heads: list[State], ids: torch.Tensor, whole: State,
               crash_is_mismatch: bool = False) -> bool:
    """Every head state, fed the rest of ``ids``, ends with the whole forward's logits. Some models
    refuse a multi-token chunk on a filled cache (prophetnet asserts one token): with
    ``crash_is_mismatch`` that counts as a mismatch, so the probe tries one token per forward."""
    if crash_is_mismatch:
        try:
            return _continues(engine, heads, ids, whole)
        except Exception:
            return False
    return all(_close(_feed(engine, head, ids[:, head.tokens_seen:]).last_logits, whole.last_logits)
               for head in heads)


def _causal(engine: Engine, whole: State, ids: torch.Tensor) -> bool:
    """Changing the last token leaves every earlier slot's K/V bitwise equal (however small the model's
    attention effects are, a bidirectional model changes them)."""
    changed = ids.clone()
    changed[0, -1] = ids[0, 0] if ids[0, 0] != ids[0, -1] else ids[0, 1]
    # within the tolerance, not bitwise: mixture-of-experts layers batch tokens per expert, so an earlier
    # token's result moves in the last bits when a later token is routed elsewhere
    return _same_kv(whole, _feed(engine, _empty(engine), changed), len(ids[0]) - 1, exact=False)


def _same_kv(a: State, b: State, slots: int, exact: bool = True) -> bool:
    """The K/V slots holding positions below ``slots`` agree in both states (bitwise if ``exact``); a
    sliding layer holds only its window, so slots are chosen by their logical position, not their index."""
    for x, y in zip(a.layers, b.layers, strict=True):
        tx, ty = x.tensors(), y.tensors()
        for name in ("keys", "values"):
            if name not in tx:
                continue
            if "positions" not in tx or not torch.equal(tx["positions"], ty["positions"]):
                return False
            keep = tx["positions"][0] < slots
            p, q = tx[name][:, :, keep], ty[name][:, :, keep]
            if not (torch.equal(p, q) if exact else _close(p, q)):
                return False
    return True


def _rolls_back(engine: Engine, whole: State, ids: torch.Tensor) -> bool:
    """Cropping the last 4 tokens and feeding them again gives the whole forward's logits."""
    back = ids.shape[1] - 4
    if whole.rollback_limit(back):
        return True  # layers that cannot crop roll back through checkpoints, which restore exact states
    return _close(_feed(engine, whole.truncated(back), ids[:, back:]).last_logits, whole.last_logits)


def _generates_alike(model: torch.nn.Module, engine: Engine, head: State, ids: torch.Tensor) -> bool:
    from .options import resolve

    options = resolve(model, {"max_new_tokens": 3, "do_sample": False})
    feed = engine.feed_for(head, ids[:, head.tokens_seen:], torch.ones_like(ids, dtype=torch.bool), {})
    mine = engine.generate(head, feed, ids, torch.ones_like(ids, dtype=torch.bool), options, _SETTINGS)[2]
    with torch.no_grad():
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,  # type: ignore[operator]
                               eos_token_id=None)[:, ids.shape[1]:]
    return torch.equal(mine, plain)


def kv_shapes(model: torch.nn.Module, adapter: StructuralAdapter) -> list[tuple[int, int, int] | None]:
    """Per layer, ``(H, D_k, D_v)`` of what one forward stored (None: no K/V)."""
    engine = Engine(bound(model, adapter))
    state = _feed(engine, _empty(engine), _random_ids(model, 2))
    out: list[tuple[int, int, int] | None] = []
    for layer in state.layers:
        t = layer.tensors()
        out.append((int(t["keys"].shape[1]), int(t["keys"].shape[3]), int(t["values"].shape[3]))
                   if "keys" in t else None)
    return out


def _feed(engine: Engine, state: State, ids: torch.Tensor) -> State:
    mask = torch.ones(1, state.tokens_seen + ids.shape[1], dtype=torch.bool, device=ids.device)
    return engine.feed(state, engine.feed_for(state, ids, mask, {}), _SETTINGS)


def _empty(engine: Engine) -> State:
    return engine.empty(1, sliding_reserve=16, fingerprint=None)


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the input embedding; the config's vocab size where the embedding is not one table
    (MusicGen keeps one per codebook)."""
    embeddings = model.get_input_embeddings()  # type: ignore[operator]
    rows = getattr(embeddings, "num_embeddings", None)
    return int(rows if isinstance(rows, int) else model.config.get_text_config().vocab_size)  # type: ignore[union-attr,operator]


def _random_ids(model: torch.nn.Module, n: int) -> torch.Tensor:
    vocab = vocab_size(model)
    low = min(16, vocab // 2)  # clear of the special ids most vocabularies start with
    gen = torch.Generator().manual_seed(1234)
    device = next(model.parameters()).device
    return torch.randint(low, vocab, (1, n), generator=gen).to(device)


def _close(actual: torch.Tensor | None, reference: torch.Tensor | None) -> bool:
    if actual is None or reference is None or actual.shape != reference.shape:
        return False
    a, b = actual.float(), reference.float()
    ulps = 1e-5 if reference.dtype == torch.float32 else 8 * torch.finfo(reference.dtype).eps
    return bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= ulps * float(b.abs().max())


def _cache_key(model: torch.nn.Module, adapter: StructuralAdapter) -> str | None:
    if verdict_cache.folder() is None:
        return None
    import transformers

    layout = [kind for kind, _ in adapter.layer_specs(model)]
    return verdict_cache.model_key(model, [PROBE_VERSION, transformers.__version__,
                                           getattr(model.config, "model_type", ""),  # type: ignore[union-attr]
                                           type(model).__name__, layout, str(next(model.parameters()).dtype)])
