"""``logprobs`` / ``top_logprobs`` in both OpenAI APIs, streamed and not.

The oracle is plain transformers: the rendered prompt prefilled in the canonical chunks
(a rule written out here: segments start where the template's "User: " begins, at least 8
tokens after the previous start, and are cut at multiples of C from their start) through a
``DynamicCache``, then ``model.generate(..., output_logits=True)``; its ``log_softmax``
must equal the server's logprobs bit for bit in float32, cold and warm, greedy and
sampled (raw logprobs: before temperature, top-k and ``logit_bias``, as vLLM's default).
"""

from __future__ import annotations

import functools
import http.client
import inspect
import json

import pytest
import torch
from tests.serving import client, live, make_server

from kvstate.serve.chat import Renderer
from kvstate.serve.cli import load
from kvstate.serve.params import CHAT_FIELDS, COMPLETION_FIELDS, Limits, parse
from tiny import count_forwards, wait_quiet

MODEL = "tiny:llama"
C = 8  # make_server's canonical chunk
# pad, bos, eos, unk and the ids past the tokenizer's table: every answer token is one printable character
NO_END = {str(i): -100 for i in (0, 1, 2, 3, *range(100, 128))}


@pytest.fixture(scope="module")
def served():
    model, tokenizer = load(MODEL)
    with live(make_server(model, tokenizer)) as url:
        yield model, tokenizer, client(url), url


def plain(model, ids: list[int], max_new: int, **options) -> tuple[list[int], list[torch.Tensor]]:
    """Plain transformers on ``ids``: the new tokens and each step's ``log_softmax`` of the raw logits."""
    from transformers import DynamicCache

    history = torch.tensor([ids])
    cache = DynamicCache(config=model.config)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # 5.24 renamed
    start = 0
    with torch.no_grad():
        for cut in chunk_ends(ids):  # the canonical prefill chunks; the last one runs inside generate
            model(history[:, start:cut], position_ids=torch.arange(start, cut)[None], use_cache=True, **{name: cache})
            start = cut
    out = model.generate(history, attention_mask=torch.ones_like(history), max_new_tokens=max_new,
                         output_logits=True, return_dict_in_generate=True, **{name: cache}, **options)
    return out.sequences[0, len(ids):].tolist(), [torch.log_softmax(s[0], -1) for s in out.logits]


def chunk_ends(ids: list[int]) -> list[int]:
    """The server's canonical chunk ends below ``len(ids)``: each segment (from 0, and from every "User: "
    at least 8 tokens after the previous segment start) cut at multiples of C from its start."""
    from kvstate.testing.tiny_tokenizer import tiny_tokenizer

    marks = tiny_tokenizer()("User: ", add_special_tokens=False).input_ids  # one token per character
    starts = [0]
    for p in range(1, len(ids)):
        if ids[p:p + len(marks)] == marks and p - starts[-1] >= 8:
            starts.append(p)
    bounds = [*starts[1:], len(ids)]
    ends = {s + k for s, b in zip(starts, bounds, strict=True) for k in range(C, b - s, C)} | set(starts[1:])
    return sorted(e for e in ends if e < len(ids))


def _options(body: dict) -> dict:
    """The ``generate`` options of ``body`` (docs/serve.md's mapping, written out by hand)."""
    options = {"sequence_bias": [[[int(k)], float(v)] for k, v in NO_END.items()]}
    if body.get("temperature", 1) == 0:
        return {**options, "do_sample": False}
    return {**options, "do_sample": True, "temperature": body["temperature"], "top_p": 1.0,
            "top_k": body.get("top_k", 0)}


def _expect(model, tokenizer, ids: list[int], body: dict, answer: str, chat: bool = True) -> list[tuple]:
    """``(token, logprob, top)`` per answer token, from the oracle: ``top`` is chat's list of the k best
    ``(token, logprob)``, or completions' map of them and the chosen token (OpenAI's shapes)."""
    if "seed" in body:
        torch.manual_seed(body["seed"])
    tokens, steps = plain(model, ids, body["max_tokens"], **_options(body))
    k = body.get("top_logprobs", body.get("logprobs") if not isinstance(body.get("logprobs"), bool) else 0)
    expected = []
    for token, lp in zip(tokens[:len(answer)], steps, strict=False):  # one character per token here
        values, top = lp.topk(k)
        best = [(tokenizer.decode([t]), v) for t, v in zip(top.tolist(), values.tolist(), strict=True)]
        text, value = tokenizer.decode([token]), lp[token].item()
        expected.append((text, value, best if chat else {**dict(best), text: value}))
    assert "".join(e[0] for e in expected) == answer, "the oracle's tokens spell another answer"
    return expected


def _chat_items(logprobs) -> list[tuple[str, float, list]]:
    return [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in logprobs.content]


def _completion_items(logprobs) -> list[tuple[str, float, dict]]:
    return list(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True))


def _ask(api, chat: bool, prompt, body: dict, stream: bool) -> tuple[str, list, int]:
    """``(answer, (token, logprob, top) per token, cached_tokens)`` through the ``openai`` client."""
    call = api.chat.completions.create if chat else api.completions.create
    where = {"messages": prompt} if chat else {"prompt": prompt}
    if not stream:
        r = call(model=MODEL, **where, **body, logit_bias=NO_END)
        choice = r.choices[0]
        items = _chat_items(choice.logprobs) if chat else _completion_items(choice.logprobs)
        return (choice.message.content if chat else choice.text), items, r.usage.prompt_tokens_details.cached_tokens
    text, items, cached, offsets = "", [], None, []
    for chunk in call(model=MODEL, **where, **body, logit_bias=NO_END, stream=True,
                      stream_options={"include_usage": True}):
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
        if not chunk.choices or chunk.choices[0].logprobs is None:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content if chat else choice.text
        items += _chat_items(choice.logprobs) if chat else _completion_items(choice.logprobs)
        offsets += [] if chat else choice.logprobs.text_offset
    assert chat or offsets == list(range(len(text))), offsets  # one character per token here
    return text, items, cached


CASES = {  # name -> (chat?, body)
    "chat, greedy, no alternatives": (True, {"temperature": 0, "max_tokens": 6, "logprobs": True}),
    "chat, greedy, top 5": (True, {"temperature": 0, "max_tokens": 6, "logprobs": True, "top_logprobs": 5}),
    "chat, greedy, top 20": (True, {"temperature": 0, "max_tokens": 3, "logprobs": True, "top_logprobs": 20}),
    "chat, sampled at 1.5 with top_k: raw logprobs": (True, {"temperature": 1.5, "max_tokens": 6, "seed": 7,
                                                            "logprobs": True, "top_logprobs": 3,
                                                            "extra_body": {"top_k": 4}}),
    "completion, greedy, 0": (False, {"temperature": 0, "max_tokens": 6, "logprobs": 0}),
    "completion, greedy, 5": (False, {"temperature": 0, "max_tokens": 6, "logprobs": 5}),
    "completion, sampled at 0.7": (False, {"temperature": 0.7, "max_tokens": 6, "seed": 3, "logprobs": 2}),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_logprobs_equal_plain_generate(served, case, stream):
    model, tokenizer, api, _ = served
    chat, body = CASES[case]
    prompt = [{"role": "user", "content": f"Say something about {case}."}] if chat else f"Of {case}:"
    ids = Renderer(tokenizer).chat(prompt).ids if chat else tokenizer(prompt).input_ids
    answer, items, _ = _ask(api, chat, prompt, body, stream)
    oracle = {**body, **body.get("extra_body", {})}
    assert answer and items == _expect(model, tokenizer, ids, oracle, answer, chat)


def test_streamed_logprobs_equal_whole_and_warm_turns_equal_cold(served):
    model, tokenizer, api, _ = served
    body = {"temperature": 0, "max_tokens": 5, "logprobs": True, "top_logprobs": 2}
    messages = []
    for turn, question in enumerate(["Hello there, what is new?", "Tell me more about it.", "And then?"]):
        messages.append({"role": "user", "content": question})
        whole = _ask(api, True, messages, body, stream=False)
        streamed = _ask(api, True, messages, body, stream=True)
        assert streamed[:2] == whole[:2], f"turn {turn + 1}"
        assert turn == 0 or whole[2] > 0, f"turn {turn + 1} must reuse the conversation"
        assert whole[1] == _expect(model, tokenizer, Renderer(tokenizer).chat(messages).ids, body, whole[0])
        messages.append({"role": "assistant", "content": whole[0]})


def test_no_logprobs_unless_asked(served):
    _, _, api, _ = served
    r = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                    temperature=0, logprobs=False)
    assert r.choices[0].logprobs is None
    assert api.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0).choices[0].logprobs is None


BAD = {  # name -> (route, fields, the param the 400 names)
    "chat logprobs 1": ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    "chat logprobs 'true'": ("/v1/chat/completions", {"logprobs": "true"}, "logprobs"),
    "chat top_logprobs 21": ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "chat top_logprobs -1": ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    "chat top_logprobs 2.5": ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    "chat top_logprobs without logprobs": ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    "chat top_logprobs with logprobs false": ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 3},
                                              "top_logprobs"),
    "completion logprobs 6": ("/v1/completions", {"logprobs": 6}, "logprobs"),
    "completion logprobs -1": ("/v1/completions", {"logprobs": -1}, "logprobs"),
    "completion logprobs true": ("/v1/completions", {"logprobs": True}, "logprobs"),
    "completion logprobs 1.5": ("/v1/completions", {"logprobs": 1.5}, "logprobs"),
    "completion top_logprobs (a chat field)": ("/v1/completions", {"logprobs": 1, "top_logprobs": 1},
                                               "top_logprobs"),
}


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_logprobs_are_400s(served, case):
    model, _, _, url = served
    route, fields, param = BAD[case]
    where = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in route else {"prompt": "Hi"}
    wait_quiet(model)  # an earlier test's reply may still be settling on the model thread
    with count_forwards(model) as forwards:
        status, answer = _post(url, route, {"model": MODEL, **where, "max_tokens": 2, **fields})
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error", answer
    assert forwards[0] == 0


@pytest.mark.parametrize("case", [c for c in sorted(BAD) if "a chat field" not in c])
def test_parse_refuses_bad_logprobs_itself(case):
    """The same values past the schema (``params.parse`` is the library's check): a typed 400 as well."""
    from kvstate.serve.errors import BadRequest

    route, fields, param = BAD[case]
    chat = "chat" in route
    body = {"model": MODEL, **({"messages": []} if chat else {"prompt": "x"}), **fields}
    with pytest.raises(BadRequest) as info:
        parse(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, Limits())
    assert info.value.param == param and info.value.status == 400


def test_parse_maps_logprobs_to_raw_step_logits():
    chat = parse({"model": MODEL, "messages": [], "logprobs": True, "top_logprobs": 4}, CHAT_FIELDS, Limits())
    completion = parse({"model": MODEL, "prompt": "x", "logprobs": 0}, COMPLETION_FIELDS, Limits())
    off = parse({"model": MODEL, "messages": [], "logprobs": False, "top_logprobs": 0}, CHAT_FIELDS, Limits())
    assert (chat.logprobs, completion.logprobs, off.logprobs) == (4, 0, None)
    for asked in (chat, completion):
        assert asked.options["output_logits"] is True and asked.options["return_dict_in_generate"] is True
    assert "output_logits" not in off.options



ANSWERS = {  # name -> (the generated text, the stop string that cuts it or None)
    "characters split into byte tokens": ("Sure! 𓀀𓀁 🫨 here.", None),
    "CJK text": ("東京は大きい。", None),
    "a stop string cut": ("Sure, here.\nUser: and more", "\nUser:"),
    "a stop string inside a token": ("Hello world, how are you", "wor"),
}


@functools.cache
def _tokenizer(kind: str):
    """Gemma's SentencePiece tokenizer (``<0xHH>`` byte fallback), or a byte-level BPE trained here
    (GPT-2's alphabet, as Llama 3 and Qwen use): both real ``tokenizers`` objects."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if kind == "gemma":
        from kvstate.testing.default_model import default_model_folder

        return AutoTokenizer.from_pretrained(default_model_folder(progress=False))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    bpe.train_from_iterator(["Sure, here it is. Hello world, how are you? And more."] * 20, trainer)  # ASCII merges
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


KINDS = [pytest.param("gemma", marks=[pytest.mark.slow, pytest.mark.default_model]), "byte-level BPE"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_reported_tokens_spell_the_answer_with_real_tokenizers(kind, case):
    """Multi-character and byte tokens: the pieces spell the answer, the tokens reported are the fewest
    whose text covers it (the end token and a cut stop string's are not), and their bytes are the answer's."""
    from kvstate.serve.logprobs import compute, pieces

    tokenizer = _tokenizer(kind)
    generated, stop = ANSWERS[case]
    tokens = [*tokenizer(generated, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    full = tokenizer.decode(tokens, skip_special_tokens=True)
    text = full[:full.find(stop)] if stop else full
    torch.manual_seed(0)
    logits = tuple(torch.randn(1, len(tokenizer)) for _ in tokens)
    items = compute(logits, tokens, 3, tokenizer, text)
    n = len(items)
    assert "".join(pieces(items, text)) == text
    assert tokenizer.decode(tokens[:n], skip_special_tokens=True).startswith(text)
    assert not tokenizer.decode(tokens[:n - 1], skip_special_tokens=True).startswith(text)
    assert [i.offset for i in items] == sorted(i.offset for i in items) and items[0].offset == 0
    if stop is None:
        assert b"".join(bytes(i.bytes) for i in items) == text.encode("utf-8")
    if "byte tokens" in case:  # the partial-character path ran
        assert any(i.token == "\ufffd" and len(i.bytes) == 1 for i in items)
    streamed = _stream(tokenizer, tokens, logits, stop)
    assert "".join(piece for piece, _ in streamed) == text and tuple(item for _, item in streamed) == items
    for item, token, step in zip(items, tokens, logits, strict=False):
        expected = torch.log_softmax(step[0], -1)
        assert item.logprob == expected[token].item() and item.token == tokenizer.decode([token])
        assert [a.logprob for a in item.top] == expected.topk(3).values.tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", sorted(ANSWERS))
@pytest.mark.parametrize("logprobs", [None, 2])
def test_the_servers_streamer_sends_only_final_text(kind, case, logprobs):
    """The server's streamer, fed one token at a time: text (or per-token pieces with logprobs) goes out only
    once final, never a replacement character of a split character nor the start of a stop string, and
    what went out is the answer (and its logprobs)."""
    from kvstate.serve.logprobs import step_of
    from kvstate.serve.runner import Job
    from kvstate.serve.streaming import Streamer

    tokenizer = _tokenizer(kind)
    generated, stop = ANSWERS[case]
    tokens = [*tokenizer(generated, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    body = {"model": MODEL, "messages": [], "max_tokens": len(tokens), "stop": [stop] if stop else None}
    if logprobs is not None:
        body.update(logprobs=True, top_logprobs=logprobs)
    request = parse(body, CHAT_FIELDS, Limits(), ())
    out: list = []
    job = Job("default", None, request, on_text=None if logprobs else out.append,  # type: ignore[arg-type]
              on_token=(lambda piece, item: out.append((piece, item))) if logprobs else None)
    streamer = Streamer(tokenizer, job)
    torch.manual_seed(0)
    for token in tokens:
        step = None if logprobs is None else step_of(torch.randn(len(tokenizer)), token, logprobs)
        streamer.add(token, step)
        pieces_so_far = [p if isinstance(p, str) else p[0] for p in out]
        assert "\ufffd" not in "".join(pieces_so_far)  # no answer here holds one
        assert not stop or stop not in "".join(pieces_so_far)
    text, _ = streamer.final(tokens)
    assert "".join(p if isinstance(p, str) else p[0] for p in out) == text
    if logprobs is not None:
        assert streamer.complete and tuple(item for _, item in out) == streamer.logprobs


def _stream(tokenizer, tokens: list[int], logits, stop: str | None) -> list:
    """What a stream sends: tokens reported one at a time as their text is final (a tail that may still
    become ``stop`` and a partial character held back, as the server's streamer does), then the rest."""
    from kvstate.serve.logprobs import Reporter, step_of

    reporter, sent = Reporter(tokenizer), []
    for i, token in enumerate(tokens):
        reporter.add(token, step_of(logits[i][0], token, 3))
        text = tokenizer.decode(tokens[:i + 1], skip_special_tokens=True)
        if stop and stop in text:
            text = text[:text.find(stop)]
            sent += reporter.ready(text, len(text))
            continue
        partial = len(text) - len(text.rstrip("\ufffd"))
        held = max([k for k in range(1, len(stop or "")) if text.endswith(stop[:k])] + [partial])
        sent += reporter.ready(text, len(text) - held)
    full = tokenizer.decode(tokens, skip_special_tokens=True)
    return sent + reporter.rest(full[:full.find(stop)] if stop and stop in full else full)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_logprobs_equal_plain_generate_in_low_precision(dtype):
    """The same oracle on a server whose weights are bf16 / fp16: still bit for bit, cold and warm."""
    model, tokenizer = load(MODEL, dtype=dtype)
    assert next(model.parameters()).dtype == getattr(torch, dtype)
    body = {"temperature": 0, "max_tokens": 5, "logprobs": True, "top_logprobs": 3}
    with live(make_server(model, tokenizer)) as url:
        messages = []
        for turn, question in enumerate(["Hello there, what is new?", "Tell me more about it."]):
            messages.append({"role": "user", "content": question})
            answer, items, cached = _ask(client(url), True, messages, body, stream=turn == 1)
            assert turn == 0 or cached > 0
            assert items == _expect(model, tokenizer, Renderer(tokenizer).chat(messages).ids, body, answer)
            messages.append({"role": "assistant", "content": answer})


@pytest.mark.parametrize("max_batch", [1, 4])
def test_streamed_logprobs_go_out_token_by_token(max_batch):
    """A stream with logprobs sends each token's piece as soon as it is final, while later tokens are still
    being generated (one-at-a-time and batched runners); the pieces and items are the whole answer's."""
    from kvstate.serve.runner import Job

    model, tokenizer = load(MODEL)
    server = make_server(model, tokenizer, max_batch=max_batch)
    try:
        messages = [{"role": "user", "content": "Hello there, what is new?"}]
        prompt, inputs = server.render(messages, True)
        body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 8, "logprobs": True,
                "top_logprobs": 2, "stream": True}
        request = parse(body, CHAT_FIELDS, server.limits, prompt.default_stop, None)
        sent = []
        with count_forwards(model) as calls:
            job = Job("default", prompt, request, inputs,
                      on_token=lambda piece, item: sent.append((calls[0], piece, item)))
            result = server.runner.submit(job).result(timeout=60)
            total = calls[0]
        assert result.completion_tokens >= 3, "the answer must be long enough to show streaming"
        assert sent[0][0] < total - 1, "the first piece must go out before the answer's last forwards"
        assert "".join(piece for _, piece, _ in sent) == result.text
        assert tuple(item for *_, item in sent) == result.logprobs
    finally:
        server.runner.close()
