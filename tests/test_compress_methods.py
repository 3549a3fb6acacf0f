"""The methods as their references compute them: KVzip's re-read score (and its chat template), Expected
Attention as kvpress 0.5.5 scores it, ChunkKV's span selection, and the global budget's ranking rules.

Each oracle is transcribed here from the reference (kvpress 0.5.5: ``KVzipPress._compute_cross_attention`` /
``score_kvzip``, ``ExpectedAttentionPress.score``, ``ChunkKVPress.compress``) and fed by plain transformers
(hooks on the projections, the model's own rotary tables), never by kvstate's watch.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

from kvstate import Session
from kvstate._compat.core import cache_kwarg  # 5.24 renamed the forward's cache keyword
from kvstate.compress import ChunkKV, ExpectedAttention, KNorm, KVzip, ScoreInput, SnapKV
from kvstate.compress.budget import global_keep, layer_keep
from kvstate.compress.observe import watch
from kvstate.compress.template import FIRST, LATER, reread_for
from kvstate.errors import UnsupportedError
from kvstate.models.tiny_tokenizer import tiny_tokenizer
from tiny import WINDOW, prompt, tiny_model

T = 3 * WINDOW


# ----- KVzip ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal,groups", [(False, 1), (False, 3), (True, 3)])
def test_attention_lse_is_softmax_and_its_normaliser(causal, groups):
    """The kernel KVzip scores through, and its blocked fallback (CUDA float32, a torch without the CPU op):
    the output and log-sum-exp of the written-out softmax, grouped K/V heads read as ``repeat_kv`` reads them."""
    from kvstate._compat import lse

    g = torch.Generator().manual_seed(0)
    q, k = (700, 700) if causal else (700, 300)
    query = torch.randn(1, 3 * groups, q, 16, generator=g)
    key, value = torch.randn(1, 3, k, 16, generator=g), torch.randn(1, 3, k, 16, generator=g)
    logits = query @ repeat_kv(key, groups).transpose(-1, -2) * 0.3
    if causal:
        logits = logits.masked_fill(torch.ones(q, k, dtype=torch.bool).triu(1), float("-inf"))
    want_out, want_lse = logits.softmax(-1) @ repeat_kv(value, groups), logits.logsumexp(-1)
    for out, norm in (lse.attention_lse(query, key, value, 0.3, causal), lse._math(query, key, value, 0.3, causal)):
        torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(norm, want_lse, atol=1e-5, rtol=1e-5)


def _plain_context(model, ids):
    """The context's cache from one plain forward."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, use_cache=True, **{cache_kwarg(model): cache})
    return cache


def _queries_of(model, ids, cache):
    """Post-RoPE queries ``[B, Hq, q, D]`` of every layer for ``ids`` fed after ``cache``, from q_proj and the
    layer's own rotary tables."""
    out, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, kwargs, i=i):
            h = kwargs["hidden_states"]
            q = module.q_proj(h).view(*h.shape[:2], -1, module.head_dim).transpose(1, 2)
            cos, sin = kwargs["position_embeddings"]
            out[i] = apply_rotary_pos_emb(q, q, cos, sin)[0]
            out[("norm", i)] = h.norm(dim=-1)  # [B, n]: KVzip+ divides each row by it
        hooks.append(layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(ids, use_cache=True, **{cache_kwarg(model): cache},
                  position_ids=torch.arange(cache.get_seq_length(), cache.get_seq_length() + ids.shape[1])[None])
    finally:
        for h in hooks:
            h.remove()
    return out


def kvpress_kvzip(model, ids, chunk, sinks=4, plus=False, skip=0, head=()):
    """``[L][B, H, T]`` KVzip scores as kvpress computes them (re-read with no instruction, as a model without
    a tokenizer gets; chunks after the previous chunk's last 8 tokens); ``plus``: with KVzip+'s normalisation
    (``kvzip_plus_normalization``: rows over the norm of the attention's input, columns times ``||W_o v||``).
    ``skip``: the re-read begins after the first ``skip`` tokens (kvpress's ``prefix_length``), each chunk
    fed after ``head`` (the instruction and the chat suffix; one chunk only)."""
    T_ = ids.shape[1]
    assert not head or chunk >= T_ - skip
    scores = [torch.zeros(1, model.config.num_key_value_heads, T_) for _ in model.model.layers]
    for start in range(skip, T_, chunk):
        end = min(start + chunk, T_)
        before = ids[:, max(start - 8, 0):start] if start and not head else ids[:, :0]
        feed = torch.cat([torch.tensor([list(head)], dtype=ids.dtype), before, ids[:, start:end]], 1)
        cache = _plain_context(model, ids)
        queries = _queries_of(model, feed, cache)
        for i, q in queries.items():
            if not isinstance(i, int):
                continue
            keys = cache.layers[i].keys  # context + re-read, post-RoPE
            B, Hq, n, D = q.shape
            H = keys.shape[1]
            sink = min(sinks, start)
            sub = torch.cat([keys[:, :, :sink], keys[:, :, start:end], keys[:, :, -n:]], dim=2)
            w = q.view(B, H, Hq // H, n, D) @ sub.unsqueeze(2).transpose(-2, -1) / math.sqrt(D)
            mask = torch.full((n, n), torch.finfo(w.dtype).min).masked_fill(
                torch.arange(n)[None, :] <= torch.arange(n)[:, None], 0.0)
            w[..., -n:, -n:] += mask
            w = w.softmax(-1)[..., sink:sink + end - start]
            if plus:
                attn = model.model.layers[i].self_attn
                Wo = attn.o_proj.weight.view(-1, H, Hq // H, D)  # [hidden, H, G, Dv]
                values = cache.layers[i].values[:, :, start:end]
                column = torch.einsum("jhgi,bhti->bhgtj", Wo, values).norm(dim=-1)  # [B, H, G, t]
                w = w / queries[("norm", i)][:, None, None, :, None] * column[:, :, :, None, :]
            scores[i][..., start:end] = w.amax(dim=(-3, -2))
    return scores


@pytest.mark.parametrize("chunk,plus", [(T, False), (16, False), (T, True), (16, True)])
def test_kvzip_scores_are_kvpress_scores(chunk, plus):
    """Scored from each query's log-sum-exp (``_compat.lse``), KVzip's and KVzip+'s scores are the
    reference's softmax probabilities, one chunk over the whole state (the layer's output then comes from the
    scoring's own kernels too) or many."""
    model = tiny_model("llama")
    ids = prompt(T)
    s = Session(model)
    s.extend(ids)
    seen, _ = watch(s._engine, model, s.state, KVzip(0.5, chunk=chunk, normalize=plus).needs(), None)
    expected = kvpress_kvzip(model, ids, chunk, plus=plus)
    for i, layer_seen in seen.items():
        torch.testing.assert_close(layer_seen.reread, expected[i], atol=1e-5, rtol=1e-4, msg=f"layer {i}")


@pytest.mark.parametrize("arch,fast", [("llama", True), ("qwen2", True), ("gemma3_text", False)])
def test_kvzip_attends_from_its_own_softmax_where_that_is_the_layers(arch, fast, monkeypatch):
    """One re-read chunk over the whole state, full attention, Llama's softmax: the layer's output comes from
    the scores' softmax instead of running the layer's attention too. The scores equal the path that runs
    both; Gemma 3 (sliding layers, its own eager function) and chunks that leave slots out never take it."""
    from kvstate.compress import reread

    model = tiny_model(arch)
    s = Session(model)
    s.extend(prompt(T))
    calls, attend = [], reread.ChunkScores.attend

    def counted(self, first, watched):
        out = attend(self, first, watched)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(reread.ChunkScores, "attend", counted)
    seen, _ = watch(s._engine, model, s.state, KVzip(0.5).needs(), None)
    one, calls[:] = list(calls), []
    watch(s._engine, model, s.state, KVzip(0.5, chunk=16).needs(), None)  # two chunks: each leaves slots out
    assert (bool(one) and all(one)) if fast else not any(one)  # Gemma 3's layers never ask
    assert not any(calls) and (bool(calls) or not fast)  # asked, and declined
    monkeypatch.setattr(reread.ChunkScores, "attend", lambda self, first, watched: None)
    both, _ = watch(s._engine, model, s.state, KVzip(0.5).needs(), None)
    for i in seen:
        torch.testing.assert_close(seen[i].reread, both[i].reread, atol=1e-6, rtol=1e-5, msg=f"layer {i}")
    assert s.state.tokens_seen == T  # the watched forwards left the session as it was


def test_kvzip_rereads_inside_the_chat_template_without_being_told(tmp_path):
    tokenizer = tiny_tokenizer()
    assert reread_for(None, tokenizer).how == "raw text"  # no template: kvpress's "\n" suffix
    assert reread_for(None, tokenizer).suffix == tuple(tokenizer.encode("\n", add_special_tokens=False))
    tokenizer.chat_template = ("{% for m in messages %}<bos>U:{{ m['content'] }}|E{% endfor %}"
                               "{% if add_generation_prompt %} A:{% endif %}")
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()  # knows its folder, not its tokenizer
    plan = reread_for(loaded)
    assert plan.how == "chat template"
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    assert (plan.first, plan.later, plan.suffix) == (encode(FIRST), encode(LATER), encode("|E A:"))
    fed = []
    s = Session(loaded)
    s.extend(prompt(20))
    observe = s._engine.observe
    s._engine.observe = lambda state, ids, *a, **k: (fed.append(ids), observe(state, ids, *a, **k))[1]
    s.compress(KVzip(0.5, chunk=16))
    body = s.state.tokens[0].tolist()
    assert fed[0][0].tolist() == [*plan.first, *plan.suffix, *body[:16]]
    assert fed[1][0].tolist() == [*plan.later, *body[8:16], *plan.suffix, *body[16:]]


@pytest.mark.parametrize("mode", ["sink", "evict", "reread"])
def test_kvzip_treats_the_template_prefix_as_its_reference_does(tmp_path, mode):
    """A state that starts with the chat template's prefix (a system prompt, the user header): Kim et al.'s
    code keeps those tokens as its sinks, in every softmax and always kept, and re-reads only the context after
    them (``prefix="sink"``, the default); kvpress's KVzipPress re-reads the same but keeps 4 sinks, and the rest
    of the prefix scores 0 (``"evict"``); ``"reread"`` re-reads it as context (kvstate's earlier re-read)."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<bos>System: answer briefly and exactly.|User:"
                               "{{ m['content'] }}|E{% endfor %}{% if add_generation_prompt %} A:{% endif %}")
    tiny_model("llama").save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    plan = reread_for(model)
    P = len(plan.prefix)
    assert P > 4 and plan.prefix == tuple(tokenizer.encode("<bos>System: answer briefly and exactly.|User:",
                                                           add_special_tokens=False))
    ids = torch.cat([torch.tensor([plan.prefix]), prompt(T)], 1)
    s = Session(model)
    s.extend(ids)
    seen, _ = watch(s._engine, model, s.state, KVzip(0.5, prefix=mode).needs(), None)
    start = 0 if mode == "reread" else P
    expected = kvpress_kvzip(model, ids, P + T, sinks=P if mode == "sink" else 4, skip=start,
                             head=(*plan.first, *plan.suffix))
    for i, layer_seen in seen.items():
        got = layer_seen.reread
        torch.testing.assert_close(got[..., start:], expected[i][..., start:], atol=1e-5, rtol=1e-4)
        if mode == "sink":
            assert torch.isinf(got[..., :P]).all()
        elif mode == "evict":
            assert (got[..., :P] == 0).all()
    kept = Session(model)
    kept.extend(ids)
    kept.compress(KVzip(0.5, prefix=mode))
    for layer in kept.state.layers:
        heads = layer.head_positions()[0]  # [H, S]: each head's kept positions (negative: padding)
        for h in range(heads.shape[0]):
            assert set(range(P if mode == "sink" else 4)) <= set(heads[h].tolist())


# ----- Expected Attention ------------------------------------------------------------------------------------
def kvpress_expected(model, ids, layer, ratio, future=512, sinks=4, epsilon=1e-2):
    """Per KV head, the slots kvpress's ExpectedAttentionPress (uniform per-head budget) keeps in ``layer``."""
    attn = model.model.layers[layer].self_attn
    captured = {}
    hook = attn.register_forward_pre_hook(lambda m, a, k: captured.update(h=k["hidden_states"]), with_kwargs=True)
    cache = _plain_context(model, ids)
    hook.remove()
    h = captured["h"][:, sinks:]
    q = attn.q_proj(h).view(1, h.shape[1], -1, attn.head_dim).transpose(1, 2).double()
    mu = q.mean(dim=2, keepdim=True)
    cov = torch.einsum("bnsi,bnsj->bnij", q - mu, q - mu) / h.shape[1]
    mu = mu.squeeze(2)
    cos, sin = model.model.rotary_emb(mu.float(), torch.arange(ids.shape[1], ids.shape[1] + future)[None])
    d = attn.head_dim
    P = torch.zeros(d, d, dtype=torch.double)
    P[d // 2:, : d // 2], P[: d // 2, d // 2:] = torch.eye(d // 2), -torch.eye(d // 2)
    R = (cos[0].double().unsqueeze(1) * torch.eye(d) + sin[0].double().unsqueeze(1) * P).mean(dim=0)
    mu, cov = mu @ R.T, R @ cov @ R.T
    keys, values = cache.layers[layer].keys[:, :, sinks:].double(), cache.layers[layer].values[:, :, sinks:].double()
    groups = model.config.num_attention_heads // keys.shape[1]
    k = repeat_kv(keys, groups).transpose(2, 3)
    scores = (mu.unsqueeze(2) @ k).squeeze(2) / math.sqrt(d) + torch.einsum("bhin,bhij,bhjn->bhn", k, cov, k) / d / 2
    scores = scores.softmax(-1).view(1, keys.shape[1], groups, -1).mean(2)
    scores = (scores + epsilon) * values.norm(dim=-1)
    scores = torch.nn.functional.pad(scores, (sinks, 0), value=scores.max().item() + 1)
    n_kept = int(ids.shape[1] * (1 - ratio))
    return [sorted(scores[0, h].topk(n_kept).indices.tolist()) for h in range(keys.shape[1])]


def test_expected_attention_keeps_what_kvpress_keeps():
    model = tiny_model("llama")
    ids = prompt(T)
    s = Session(model)
    s.extend(ids)
    s.compress(ExpectedAttention(0.5, scope="layer"))  # kvpress's per-head selection, every prefill query
    for i, layer in enumerate(s.state.layers):
        got = [sorted(p for p in layer.positions[0, h].tolist() if p >= 0) for h in range(layer.keys.shape[1])]
        assert got == kvpress_expected(model, ids, i, 0.5), f"layer {i}"


# ----- ChunkKV --------------------------------------------------------------------------------------------
def kvpress_chunks(global_scores, ratio, chunk):
    """ChunkKVPress.compress's kept indices for scores ``[1, H, S]``."""
    S = global_scores.shape[-1]
    full, rest = S // chunk, S % chunk
    main = global_scores[..., : full * chunk].sum(dim=1).view(-1, full, chunk).mean(dim=-1)
    if rest:
        main = torch.cat([main, global_scores[..., -rest:].sum(dim=1).mean(dim=-1, keepdim=True)], dim=-1)
    kept = max(1, int((full + (rest > 0)) * (1 - ratio)))
    out = []
    for c in main.topk(kept, dim=-1).indices[0]:
        out += list(range(c * chunk, min((c + 1) * chunk, S)))
    return sorted(out)


def test_chunkkv_keeps_the_spans_kvpress_keeps():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 23, 8)
    x = ScoreInput(0, 1, keys, torch.arange(23)[None])
    for ratio in (0.3, 0.5, 0.8):
        policy = ChunkKV(policy=KNorm(ratio), chunk=5)  # a wrapper takes its ratio from the policy it wraps
        keep = policy.choose(x)
        assert torch.equal(keep[0, 0], keep[0, 1])  # every head keeps the same spans
        scores = KNorm().scores(x)[:, None].expand(1, 2, 23)
        assert keep[0, 0].nonzero().flatten().tolist() == kvpress_chunks(scores, ratio, 5), ratio


# ----- the global budget ------------------------------------------------------------------------------------
def test_global_ranking_counts_every_entry_and_takes_the_best():
    torch.manual_seed(1)
    scores = [torch.rand(1, 2, 10), torch.rand(1, 2, 10) + 1.0]  # layer 1 outranks layer 0 everywhere
    valid = [torch.ones(1, 2, 10, dtype=torch.bool), torch.ones(1, 2, 10, dtype=torch.bool)]
    valid[0][0, 1, :4] = False  # padding: never a candidate, never kept
    keep = global_keep(scores, valid, [False, False], ratio=0.5)
    candidates = 2 * 20 - 4
    assert sum(int(k.sum()) for k in keep) == candidates - int(candidates * 0.5)
    assert int(keep[1].sum()) == 18 and not bool(keep[0].any())  # the 18 best are all layer 1's


def test_the_floor_keeps_a_share_of_every_head():
    scores = [torch.tensor([[[9.0] * 8, [0.0] * 8]])]  # head 1 scores nothing
    valid = [torch.ones(1, 2, 8, dtype=torch.bool)]
    assert int(global_keep(scores, valid, [False], ratio=0.5, count="entries")[0][0, 1].sum()) == 0
    floored = global_keep(scores, valid, [False], ratio=0.5, floor=0.5, count="entries")[0]
    assert int(floored[0, 1].sum()) == int(0.5 * int(0.5 * 8)) and int(floored.sum()) == 8


def test_counting_bytes_evens_the_heads_of_a_layer_and_counting_padding_cuts_the_ranking_short():
    """``count="bytes"``: the ranking sets each layer's share (8 of 16 entries here, all of them head 0's); the
    layer's two heads then keep 4 each, so nothing pads: half the entries is half the bytes."""
    scores = [torch.tensor([[[9.0, 8, 7, 6, 5, 4, 3, 2], [-1.0, -1, -1, -1, -0.5, -0.5, -0.5, -0.5]]]),
              torch.tensor([[[0.5] * 8, [0.4] * 8]])]  # a second layer the ranking leaves empty
    valid = [torch.ones(1, 2, 8, dtype=torch.bool)] * 2
    entries = global_keep(scores, valid, [False, False], ratio=0.75, count="entries")
    assert entries[0].sum(-1).tolist() == [[8, 0]] and int(entries[1].sum()) == 0
    even = global_keep(scores, valid, [False, False], ratio=0.75, count="bytes")
    assert even[0].sum(-1).tolist() == [[4, 4]] and int(even[1].sum()) == 0
    assert even[0][0, 0, :4].all() and even[0][0, 1, 4:].all()  # each head's own best
    # 3 layers of 2 heads given 3, 3 and 2 of 8 entries: 1 each, then the one spare pair to the first layer
    # with a remainder (8 in all: never over the budget, and within H - 1 of it)
    three = [torch.tensor([[[10.0, 9, 0, 0], [8.0, 0, 0, 0]]]), torch.tensor([[[7.0, 0, 0, 0], [6.0, 5, 0, 0]]]),
             torch.tensor([[[4.0, 0, 0, 0], [3.0, 0, 0, 0]]])]
    flat = [k.sum(-1).tolist() for k in global_keep(three, [torch.ones(1, 2, 4, dtype=torch.bool)] * 3,
                                                     [False] * 3, ratio=0.68, count="entries")]
    assert flat == [[[2, 1]], [[1, 2]], [[1, 1]]]
    counts = [k.sum(-1).tolist() for k in global_keep(three, [torch.ones(1, 2, 4, dtype=torch.bool)] * 3,
                                                       [False] * 3, ratio=0.68, count="bytes")]
    assert counts == [[[2, 2]], [[1, 1]], [[1, 1]]]
    # count="padded": the ranking alone, cut to its 6 best so that each layer padded to its fullest head
    # holds 2 x 2 + 2 x 2 + 0 = 8 entries (the 8 best would pad to 10)
    padded = global_keep(three, [torch.ones(1, 2, 4, dtype=torch.bool)] * 3, [False] * 3, ratio=0.68, count="padded")
    assert [k.sum(-1).tolist() for k in padded] == [[[2, 1]], [[1, 2]], [[0, 0]]]
    # count="filled" (the default): the same cut, then each head fills its layer's padded row with its next-best
    filled = global_keep(three, [torch.ones(1, 2, 4, dtype=torch.bool)] * 3, [False] * 3, ratio=0.68)
    assert [k.sum(-1).tolist() for k in filled] == [[[2, 2]], [[2, 2]], [[0, 0]]]
    assert all(bool((f | ~p).all()) for f, p in zip(filled, padded, strict=True))  # every slot the cut kept stays
    assert filled[0][0, 1].tolist() == [True, True, False, False]  # head 1 adds its next best: a tie, the earliest


def test_sliding_layers_stay_whole_unless_the_ratio_asks_for_them_then_the_full_layers_do():
    full = torch.arange(20.0).view(1, 1, 20)  # one full layer, 20 slots
    window = torch.full((1, 1, 10), 100.0)  # one sliding layer, 10 slots, scored above all
    valid = [torch.ones(1, 1, 20, dtype=torch.bool), torch.ones(1, 1, 10, dtype=torch.bool)]
    light = global_keep([full, -window], valid, [False, True], ratio=0.3)  # 9 to drop: the full layer gives them
    assert bool(light[1].all()) and int(light[0].sum()) == 11
    ranked = global_keep([full, -window], valid, [False, True], ratio=0.3, mode="ranked")
    assert int(ranked[1].sum()) == 1  # ranked with the rest, the low-scored window goes first
    heavy = global_keep([full, window], valid, [False, True], ratio=0.8, floor=0.25)  # 24 to drop of 30
    assert int(heavy[0].sum()) == int(0.25 * int(0.2 * 20))  # neither kind can stay whole: ranked together
    assert int(heavy[0].sum()) + int(heavy[1].sum()) == 30 - int(30 * 0.8)
    # Gemma 3's case: the sliding layers hold most slots. 18 of 30 stay: the sliding layer (20) cannot stay
    # whole, the full one (10) can, so it does, and the sliding layer keeps its 8 best, scored above it or not
    few, many = torch.arange(10.0).view(1, 1, 10), torch.arange(20.0).view(1, 1, 20)
    valid = [torch.ones(1, 1, 10, dtype=torch.bool), torch.ones(1, 1, 20, dtype=torch.bool)]
    kept = global_keep([few, many], valid, [False, True], ratio=0.4)
    assert bool(kept[0].all()) and kept[1][0, 0].nonzero().flatten().tolist() == list(range(12, 20))
    together = global_keep([few, many], valid, [False, True], ratio=0.4, mode="ranked")
    assert int(together[0].sum()) == 4  # one ranking: the full layer gives 6 of its 10


def test_layer_budget_keeps_k_per_head_and_prefers_earlier_slots_on_ties():
    scores = torch.tensor([[[1.0, 1.0, 1.0, 0.0], [0.0, 2.0, 1.0, float("inf")]]])
    keep = layer_keep(scores, torch.ones(1, 2, 4, dtype=torch.bool), 2)
    assert keep[0].tolist() == [[True, True, False, False], [False, True, False, True]]


def test_kvzip_on_a_hybrid_model_keeps_sliding_layers_whole_when_it_can():
    s = Session(tiny_model("gemma3_text"))
    s.extend(prompt(T))
    light = s.fork()
    report = light.compress(KVzip(0.2))
    for before, after in zip(s.state.layers, light.state.layers, strict=True):
        if before.window is not None:  # whole: its window, no slot of it evicted
            assert after.entries == 2 * (WINDOW - 1)
    budget = report.window_entries - int(report.window_entries * 0.2)  # padding included (the default)
    assert report.entries_after + report.padding <= budget
    assert s.fork().compress(KVzip(0.2, count="entries")).entries_after == budget
    heavy = s.fork()
    report = heavy.compress(KVzip(0.5))
    assert report.entries_after + report.padding <= report.window_entries - int(report.window_entries * 0.5)
    assert any(after.entries < 2 * (WINDOW - 1) for after in heavy.state.layers if after.window is not None)


def test_recent_sliding_layers_keep_their_newest_slots_when_they_must_give():
    """``sliding="recent"``: the full layers stay whole and each sliding layer that must give keeps its newest
    slots, the ones the next queries' windows still reach; a ratio the full layers cannot stay
    whole under is refused."""
    s = Session(tiny_model("gemma3_text"))
    n = 2 * WINDOW  # the sliding layers (3 x 11 slots x 2 heads) outweigh the full one (24 x 2)
    s.extend(prompt(n))
    recent = s.fork()
    recent.compress(KVzip(0.5, sliding="recent"))
    gave = 0
    for before, after in zip(s.state.layers, recent.state.layers, strict=True):
        heads = after.head_positions()[0]
        if before.window is None:
            assert after.entries == before.entries
            continue
        gave += after.entries < before.entries
        for h in range(heads.shape[0]):  # (the sinks lie before the window: a compressed sliding layer drops them)
            newest = sorted(p for p in heads[h].tolist() if p >= 0)
            assert newest == list(range(n - len(newest), n))
    assert gave
    with pytest.raises(UnsupportedError, match="full-attention layers whole"):
        s.fork().compress(KVzip(0.7, sliding="recent"))


def test_a_budget_just_big_enough_for_one_kind_does_not_empty_the_other():
    """The kind that, giving the ratio alone, keeps the larger share of its own entries gives it. The earlier
    rule kept the sliding layers whole whenever they fit, and a budget just big enough for them left the full
    layer almost nothing (Gemma-3-270M scored 0 on its 2k RULER questions at 58% kept, 74% of uncompressed at
    50%). ``"recent"`` gives the full layers the budget first at every ratio, keeping the sliding layers'
    newest slots."""
    full, window = torch.arange(10.0).view(1, 1, 10), torch.arange(20.0).flip(-1).view(1, 1, 20)
    valid = [torch.ones(1, 1, 10, dtype=torch.bool), torch.ones(1, 1, 20, dtype=torch.bool)]

    def held(scores, mode, ratios=(0.6, 0.5, 0.3, 0.1)):
        return [[int(k.sum()) for k in global_keep(scores, [torch.ones_like(x, dtype=torch.bool) for x in scores],
                                                   [False, True], ratio=r, mode=mode, count="entries")]
                for r in ratios]

    # the sliding layer holds more: it gives at every ratio (before, at 0.3 the full layer kept 1 of its 10)
    assert held([full, window], "whole") == held([full, window], "recent") == [[10, 2], [10, 5], [10, 11], [10, 17]]
    whole = global_keep([full, window], valid, [False, True], ratio=0.3, count="entries")
    recent = global_keep([full, window], valid, [False, True], ratio=0.3, mode="recent", count="entries")
    assert whole[1][0, 0].nonzero().flatten().tolist() == list(range(11))  # its best-scored (the oldest here)
    assert recent[1][0, 0].nonzero().flatten().tolist() == list(range(9, 20))  # its newest
    # the full layer holds more: under "whole" it gives, the sliding layer staying whole; "recent" keeps it whole
    wide, narrow = torch.arange(20.0).view(1, 1, 20), torch.arange(10.0).view(1, 1, 10)
    assert held([wide, narrow], "whole") == [[2, 10], [5, 10], [11, 10], [17, 10]]
    assert held([wide, narrow], "recent", (0.3, 0.1)) == [[20, 1], [20, 7]]  # (0.5 would empty it: refused)
    with pytest.raises(UnsupportedError, match="a floor above 0"):
        held([wide, narrow], "recent", (0.5,))


def test_recent_with_a_floor_gives_the_full_layers_what_the_sliding_floors_leave():
    """Neither kind can give the ratio alone: with ``sliding="recent"`` and a floor, each sliding head keeps its
    floor alone (its best slots) and the full layers share the rest in one ranking; without a floor, refused."""
    full = torch.arange(10.0).view(1, 1, 10)  # one full layer, 10 slots
    window = torch.arange(20.0).flip(-1).view(1, 1, 20)  # one sliding layer, 20 slots, its oldest scored best
    valid = [torch.ones(1, 1, 10, dtype=torch.bool), torch.ones(1, 1, 20, dtype=torch.bool)]
    # 6 of 30 stay: the full layer (10) cannot stay whole, nor the sliding one (20); the sliding head's floor is
    # int(0.25 * int(0.2 * 20)) = 1 slot, its best; the full layer keeps its 5 best
    kept = global_keep([full, window], valid, [False, True], ratio=0.8, floor=0.25, mode="recent", count="entries")
    assert kept[1][0, 0].nonzero().flatten().tolist() == [0]
    assert kept[0][0, 0].nonzero().flatten().tolist() == [5, 6, 7, 8, 9]
    together = global_keep([full, window], valid, [False, True], ratio=0.8, floor=0.25, count="entries")
    assert int(together[1].sum()) == 5  # sliding="whole" ranks both kinds together there: 5 of the 6
    with pytest.raises(UnsupportedError, match="a floor above 0"):
        global_keep([full, window], valid, [False, True], ratio=0.8, mode="recent")
    s = Session(tiny_model("gemma3_text"))
    s.extend(prompt(3 * WINDOW))
    question = prompt(4, seed=9)
    policy = SnapKV(0.75, window=4, kernel=3, scope="global", sliding="recent", floor=0.2)
    squeezed = s.fork()
    report = squeezed.compress(policy, query_ids=question)
    floor, in_full = max(1, int(0.2 * int(0.25 * (WINDOW - 1)))), 0  # 20% of each head's quarter of the window
    for before, after in zip(s.state.layers, squeezed.state.layers, strict=True):
        kept = after.head_positions()[0].ge(0).sum(-1).tolist()
        if before.window is not None:
            assert kept == [floor] * 2
        else:
            in_full += sum(kept)
    sliding = sum(layer.window is not None for layer in s.state.layers)
    assert in_full == report.entries_after - 2 * floor * sliding > 2 * floor  # the rest went to the full layers
    assert report.entries_after <= report.window_entries - int(report.window_entries * 0.75)
