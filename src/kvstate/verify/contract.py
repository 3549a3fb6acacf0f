"""Matrix rows for the kvstate path, the token boundary, the core contract and model-specific cases."""

from __future__ import annotations

from dataclasses import replace

import torch

from .rows import Matrix, Result, cache_variant_rows, faulty_prefix, greedy, plain, plain_rows, reference


def kvstate_path_rows(m: Matrix) -> None:
    def path() -> Result:
        s = m.session(state=faulty_prefix(m))
        return greedy(s, m.ids, m.n)

    m.row("kvstate: generate(full history)", "kvstate", "Session.generate over the whole history", path,
          {"instance": "same", "full_mask": True})


def boundary_rows(m: Matrix) -> None:
    def processed() -> Result:
        s = m.session()
        logits = s.extend(m.ids)
        if m.fault == "refeed-last":  # the processed last token goes in again
            logits = s.extend(m.ids[:, -1:])
        tokens = s.generate(s.tokens, max_new_tokens=m.n, do_sample=False)
        return logits, tokens

    m.row("kvstate: fully processed history", "kvstate", "extend(prompt), generate(prompt): nothing re-fed", processed,
          {"instance": "same", "refed": m.fault == "refeed-last"})
    full = m.session()
    full.extend(m.ids)
    twice = torch.cat([m.ids, m.ids[:, -1:]], 1)
    m.row("plain: re-fed last token", "plain", "cache(prompt) + prompt[-1] with a full mask",
          lambda: plain(m.model, full.state, twice, m.n, mask=True, positions=False), {"refed": True})


def contract_rows(m: Matrix) -> None:
    """The core issue's checks: reset, fork, truncate, chunked prefill, manual loop."""
    L = m.ids.shape[1]
    split = max(1, L - max(2, L // 4))
    other = torch.flip(m.ids[:, 1:], dims=[1])[:, :L // 2 + 1]

    def reset() -> Result:
        s = m.session()
        s.generate(other, max_new_tokens=4, do_sample=False)
        s.reset()
        s.extend(m.ids[:, :split])
        return greedy(s, m.ids, m.n)

    def fork() -> Result:
        s = m.session()
        s.extend(m.ids[:, :split])
        f = s.fork()
        s.extend(other)  # the original moves on; the fork must not see it
        return greedy(f, m.ids, m.n)

    def truncate() -> Result:
        s = m.session()
        s.extend(m.ids[:, :split])  # a call boundary: recurrent layers get a checkpoint here
        s.extend(other[:, :8])
        s.truncate(split)
        return greedy(s, m.ids, m.n)

    def chunked() -> Result:
        s = m.session(chunk_size=max(2, split // 4))
        s.extend(m.ids[:, :split])
        return greedy(s, m.ids, m.n)

    def divergent() -> Result:
        s = m.session()
        s.extend(m.ids[:, :split])
        s.generate(torch.cat([m.ids[:, :split], other[:, :6]], 1), max_new_tokens=4, do_sample=False)
        return greedy(s, m.ids, m.n)  # rolls back (or resumes from a checkpoint)

    def manual() -> Result:
        s = m.session()
        first = logits = s.extend(m.ids)
        out = []
        for _ in range(m.n):
            out.append(logits.argmax(-1, keepdim=True))
            logits = s.extend(out[-1])
        return first, torch.cat(out, 1)

    for name, description, run in (
            ("reset after other chat", "another conversation, reset(), then resume", reset),
            ("fork", "fork, the original moves on, the fork resumes", fork),
            ("truncate", "extend(prefix), extend(8 other), truncate(prefix), resume", truncate),
            ("chunked prefill", "prefix fed in chunks of prefix/4", chunked),
            ("divergent history", "another continuation first; generate rolls back", divergent),
            ("manual decode loop", "extend() one token at a time", manual)):
        m.row(f"kvstate: {name}", "kvstate", description, run, {"instance": "same", "full_mask": True},
              canonical=run is not manual)  # extend() decodes through kvstate's forward, not generate's


def sliding_row(m: Matrix) -> None:
    windows = [w for layer in m.prefix.layers if (w := layer.meta().get("window"))]
    L = m.ids.shape[1]
    if not windows:
        return
    if min(windows) < L:
        m.skipped.append(f"sliding window crossed: the main prompt ({L} tokens) already crosses window {min(windows)}")
        return
    if m.quick:
        m.skipped.append("sliding window crossed: --quick")
        return
    long = m.ids.repeat(1, min(windows) // L + 2)[:, :min(windows) + 24]
    ref = reference(m.model, long, m.n)

    def run() -> Result:
        s = m.session()
        s.extend(long[:, :-4])
        return greedy(s, long, m.n)

    m.row("kvstate: sliding window crossed", "kvstate", f"{long.shape[1]}-token prompt past window {min(windows)}", run,
          {"instance": "same", "full_mask": True}, ref=ref, cold=m.cold_run(long), floor=m.floor_of(long, ref))


def padded_row(m: Matrix) -> None:
    if not m.adapter.caps.padding:
        m.skipped.append(f"left-padded batch: {m.adapter.caps.name} models refuse padding")
        return
    L = m.ids.shape[1]
    short = m.ids[:, L // 3:]
    batch = torch.cat([m.ids, torch.cat([torch.zeros_like(m.ids[:, :L // 3]), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :L // 3] = 0
    short_logits, short_tokens = reference(m.model, short, m.n)
    ref = (torch.cat([m.ref_logits, short_logits]), torch.cat([m.ref_tokens, short_tokens]))

    def run(warm: bool = True) -> Result:
        s = m.session()
        if warm:
            s.extend(batch[:, :-2], mask[:, :-2])
        out = s.generate(batch, attention_mask=mask, max_new_tokens=m.n, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
        return out.logits[0], out.sequences

    m.row("kvstate: left-padded batch", "kvstate", "2 rows of different lengths vs each row alone", run,
          {"instance": "same", "full_mask": True}, ref=ref, cold=run(warm=False), floor=m.floor_of(batch, ref, mask))


def multimodal_rows(m: Matrix) -> None:
    image = m.adapter.synthetic_image(m.model)
    if image is None:
        return
    span, inputs = image
    ids = torch.cat([m.ids[:, :6], span, m.ids[:, 6:]], 1)
    kinds = m.adapter.plain_inputs(m.model, ids, inputs)
    ref = reference(m.model, ids, m.n, **kinds)
    cold = m.cold_run(ids, **inputs)
    s = m.session()
    s.extend(ids[:, :-1], **inputs)
    state = s.state
    m.row("kvstate: image prefix", "kvstate", "image in the state, resume on the same instance",
          lambda: greedy(m.session(state=state), ids, m.n, **inputs), {"instance": "same"}, ref=ref, cold=cold)
    fresh = m.fresh_model()
    if fresh is None:
        return
    def kvstate_fresh() -> Result:
        if m.fault == "zero-rope-deltas":  # rely on zeroed model-side state instead of explicit positions
            m.adapter.restore_extras(fresh, {k: torch.zeros_like(v) for k, v in state.extras.items()})
            return plain(fresh, state, ids, m.n, mask=True, positions=False)
        return greedy(m.session(fresh, state=state), ids, m.n, **inputs)

    m.row("kvstate: image prefix, fresh instance", "kvstate", "the same state on a new instance", kvstate_fresh,
          {"instance": "fresh", "full_mask": True, "twin": "kvstate: image prefix"}, ref=ref, cold=cold)
    m.adapter.reset_model(fresh)
    m.row("plain: image prefix, fresh instance, mask only", "plain", "the image cache on a new instance, full mask",
          lambda: plain(fresh, state, ids, m.n, mask=True, positions=False), {"instance": "fresh"}, ref=ref)


def video_rows(m: Matrix) -> None:
    """The control matrix again on a video prefix (media state: the long seed's own modality): the cache
    variants and the plain resume rows, named ``<group>: video, <row>``."""
    video = m.adapter.synthetic_video(m.model)
    if video is None:
        return
    if m.fault is not None:
        m.skipped.append("video rows: a planted fault applies to the text matrix")
        return
    span, inputs = video
    ids = torch.cat([m.ids[:, :6], span, m.ids[:, 6:]], 1)
    sub = Matrix(m.model, ids, m.n, fresh=m.fresh, spec=m.spec, attn=m.attn, quick=m.quick, inputs=inputs,
                 given_floor=m.floor)
    sub._fresh_model = m.fresh_model()
    cache_variant_rows(sub)
    plain_rows(sub)
    for row in sub.rows:
        facts = dict(row.facts or {})
        if "twin" in facts:
            facts["twin"] = _video_name(facts["twin"])
        m.rows.append(replace(row, name=_video_name(row.name), facts=facts))
    m.skipped.extend(f"video: {reason}" for reason in sub.skipped)


def _video_name(name: str) -> str:
    group, _, rest = name.partition(": ")
    return f"{group}: video, {rest}"
