"""Batching in the server: ``kvstate serve --max-batch N`` answers concurrent requests, each bit for bit
as it answers the request alone, with the queue, 429s and cancel-on-disconnect of the one-at-a-time server.

"Alone" is the same server asked one request at a time; greedy answers are also checked against
plain ``model.generate`` (an oracle kvstate does not produce), cut at the stop strings by the test's rule.
"""

from __future__ import annotations

import threading
import time

import pytest
from tests.serving import client, live, make_server, reference

from kvstate.serve import Server, Settings
from kvstate.serve.chat import Renderer
from kvstate.serve.cli import load

TOPICS = ["the sea", "bread", "owls", "rain", "maps", "tea", "salt", "ferns"]


@pytest.fixture(scope="module")
def tiny() -> tuple:
    return load("tiny:llama")


def ask(api, i: int, stream: bool) -> tuple:
    """Request ``i``: even ones greedy, odd ones sampled with seed ``i``; every fourth from 1 and 2 also asks for
    logprobs with 3 alternatives. ``(text, finish, completion tokens, logprobs as plain data)``."""
    options = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": i}
    if i % 4 in (1, 2):
        options.update(logprobs=True, top_logprobs=3)
    messages = [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}]
    if not stream:
        r = api.chat.completions.create(model="tiny:llama", messages=messages, max_tokens=12, **options)
        lp = r.choices[0].logprobs
        return (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens,
                None if lp is None else [t.model_dump() for t in lp.content])
    parts, finish, used, lps = [], None, None, []
    for chunk in api.chat.completions.create(model="tiny:llama", messages=messages, max_tokens=12, stream=True,
                                             stream_options={"include_usage": True}, **options):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            if chunk.choices[0].logprobs is not None:
                lps += [t.model_dump() for t in chunk.choices[0].logprobs.content]
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    return "".join(parts), finish, used, lps or None


def test_concurrent_requests_get_their_answers_alone(tiny):
    """Eight requests sent 50 ms apart to an idle server: ``--batch-gather-ms`` (2 s here, so timing cannot
    split the burst; the wait ends at a full batch) admits all of them in the first step, and each answers
    as it does alone."""
    from kvstate.cli import _parser

    parse = _parser().parse_args
    assert parse(["serve"]).batch_gather_ms == 20 and parse(["serve", "--batch-gather-ms", "0"]).batch_gather_ms == 0
    model, tokenizer = tiny
    server = make_server(model, tokenizer, max_batch=8, batch_gather_ms=2000)
    scheduler, steps = server.runner.scheduler, []  # (waiting, running) when each step starts
    stepping = scheduler.stepping

    def recorded():
        steps.append((len(scheduler._waiting), scheduler.running))
        return stepping()

    scheduler.stepping = recorded
    with live(server) as url:
        api = client(url)
        server.runner.gather = 0  # one at a time: nothing to gather
        alone = [ask(api, i, stream=bool(i % 3)) for i in range(8)]
        server.runner.gather, steps[:] = 2.0, []
        together: list = [None] * 8
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(client(url), i, bool(i % 3))))
                   for i in range(8)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join(timeout=300)
        assert server.runner.peak == 8 and steps[0] == (8, 0), steps  # the burst, admitted in the first step
    assert together == alone  # text, finish, usage and every logprob, bit for bit
    for i, answer in enumerate(alone):
        assert (answer[3] is not None) == (i % 4 in (1, 2)), i
        for token in answer[3] or ():  # the chosen token's logprob is in place among the alternatives
            assert token["top_logprobs"] and token["logprob"] <= token["top_logprobs"][0]["logprob"], i
        if i % 4 == 2:  # greedy: the chosen token is the most likely one
            assert all(t["token"] == t["top_logprobs"][0]["token"] for t in answer[3]), i
    renderer = Renderer(tokenizer)
    for i in range(0, 8, 2):
        messages = [{"role": "user", "content": f"Tell me about {TOPICS[i]}."}]
        assert alone[i][0] == reference(model, tokenizer, renderer.chat(messages).ids, 12), i


def test_a_conversation_resumes_from_the_pool(tiny):
    model, tokenizer = tiny
    server = make_server(model, tokenizer, max_batch=4)
    with live(server) as url:
        api = client(url)
        messages = [{"role": "user", "content": "Hello there, tell me a story."}]
        first = api.chat.completions.create(model="tiny:llama", messages=messages, max_tokens=8, temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And then?"}]
        second = api.chat.completions.create(model="tiny:llama", messages=messages, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    ids = Renderer(tokenizer).chat(messages).ids
    assert second.choices[0].message.content == reference(model, tokenizer, ids, 8)


def test_a_full_queue_is_a_429_and_a_disconnect_leaves_the_server_healthy(tiny):
    import openai

    model, tokenizer = tiny
    server = make_server(model, tokenizer, max_batch=4, max_queue=2)
    long = {"temperature": 0, "logit_bias": None, "stop": None}
    with live(server) as url:
        api = client(url)
        streams = [api.chat.completions.create(model="tiny:llama", messages=[{"role": "user", "content": "Talk."}],
                                               max_tokens=2000, stream=True, **long) for _ in range(2)]
        for s in streams:
            next(iter(s))  # both are running
        with pytest.raises(openai.RateLimitError):
            api.chat.completions.create(model="tiny:llama", messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=2)
        for s in streams:
            s.close()  # the clients go away
        deadline = time.monotonic() + 30
        while server.runner.pending and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.runner.pending == 0, "a cancelled request never left the batch"
        text, finish, _, _ = ask(api, 0, stream=False)
    assert finish in ("stop", "length") and text == ask_alone(model, tokenizer)


def ask_alone(model, tokenizer, i: int = 0) -> str:
    messages = [{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}."}]
    return reference(model, tokenizer, Renderer(tokenizer).chat(messages).ids, 12)


def test_a_long_prompt_fed_in_pieces_answers_as_a_whole_prefill_and_resumes(tiny):
    """A step feeds about --prefill-per-step prompt tokens: a history longer than that is fed in pieces between the
    running answer's steps. Every answer is plain generate's, and the next turn reuses the pieced prompt."""
    model, tokenizer = tiny
    server = make_server(model, tokenizer, max_batch=4, prefill_per_step=24)
    words = " ".join(f"{TOPICS[i % len(TOPICS)]} {i}" for i in range(40))
    messages = [{"role": "user", "content": f"Summarize: {words}."}]
    renderer = Renderer(tokenizer)
    assert len(renderer.chat(messages).ids) > 4 * 24  # several pieces
    with live(server) as url:
        talk = client(url).chat.completions.create(model="tiny:llama", messages=[{"role": "user", "content": "Talk."}],
                                                   max_tokens=40, temperature=0, stream=True)
        first = next(iter(talk))  # running
        api = client(url)
        long = api.chat.completions.create(model="tiny:llama", messages=messages, max_tokens=8, temperature=0)
        streamed = (first.choices[0].delta.content or "") + "".join(c.choices[0].delta.content or "" for c in talk
                                                                      if c.choices)
        messages += [{"role": "assistant", "content": long.choices[0].message.content},
                     {"role": "user", "content": "Shorter?"}]
        again = api.chat.completions.create(model="tiny:llama", messages=messages, max_tokens=8, temperature=0)
    assert long.choices[0].message.content == reference(model, tokenizer, renderer.chat(messages[:1]).ids, 8)
    assert streamed == reference(model, tokenizer, renderer.chat([{"role": "user", "content": "Talk."}]).ids, 40)
    assert long.usage.prompt_tokens_details.cached_tokens == 0  # the pieces are this request's own work
    assert again.usage.prompt_tokens_details.cached_tokens > 4 * 24
    assert again.choices[0].message.content == reference(model, tokenizer, renderer.chat(messages).ids, 8)


def test_concurrent_requests_share_a_system_prompt_computed_once(tiny):
    model, tokenizer = tiny
    server = make_server(model, tokenizer, max_batch=4)
    system = {"role": "system", "content": "You are a terse assistant who answers about the weather in one line."}
    results: list = [None] * 4

    def one(i: int) -> None:
        messages = [system, {"role": "user", "content": f"Day {i}?"}]
        r = client(url).chat.completions.create(model="tiny:llama", messages=messages, max_tokens=6, temperature=0)
        results[i] = (messages, r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)

    with live(server) as url:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    renderer = Renderer(tokenizer)
    first = renderer.chat(results[0][0]).ids
    # the system prompt is its own canonical segment: everything before the user turn's mark ("User: ")
    shared = next(p for p in range(len(first)) if first[p:p + len(server.marks)] == list(server.marks))
    cached = [r[2] for r in results]
    assert sum(c > 0 for c in cached) >= 3 and all(c >= shared for c in cached if c), cached  # all but the first
    for messages, answer, _ in results:
        assert answer == reference(model, tokenizer, renderer.chat(messages).ids, 6)


def test_an_option_the_sampler_lacks_runs_alone_as_the_one_at_a_time_server_runs_it(tiny):
    """Every option ``params`` produces is batched; anything else (here ``no_repeat_ngram_size``, a generate
    option no route maps) runs through ``Session.generate`` between two steps: the one-at-a-time answer."""
    from kvstate.serve.params import Request
    from kvstate.serve.runner import Job

    model, tokenizer = tiny
    answers = []
    for max_batch in (1, 4):
        server = make_server(model, tokenizer, max_batch=max_batch)
        try:
            prompt, _ = server.render([{"role": "user", "content": "Repeat after me: la la la la."}], True)
            request = Request({"max_new_tokens": 10, "do_sample": False, "no_repeat_ngram_size": 2}, (), False,
                              False, None)
            answers.append(server.runner.submit(Job("default", prompt, request)).result(timeout=60))
        finally:
            server.runner.close()
    assert (answers[0].text, answers[0].completion_tokens) == (answers[1].text, answers[1].completion_tokens)


PROCESSED = [  # OpenAI fields -> the generate options that mean the same
    ({"frequency_penalty": 1.5, "logit_bias": {"5": -100}}, {"sequence_bias": [[[5], -100.0]], "penalties": (0, 1.5)}),
    ({"presence_penalty": 1.2}, {"penalties": (1.2, 0)}),
    ({"extra_body": {"repetition_penalty": 1.4}}, {"repetition_penalty": 1.4}),
    ({"logit_bias": {"70": 40, "74": -100}, "frequency_penalty": -0.5},
     {"sequence_bias": [[[70], 40.0], [[74], -100.0]], "penalties": (0, -0.5)}),
    ({"temperature": 1.3, "seed": 11, "extra_body": {"min_p": 0.3}}, None),  # sampled: alone = batched only
]


def test_penalties_and_logit_bias_decode_in_the_batch(tiny):
    """logit_bias, repetition_penalty and the presence / frequency penalties are the request's own logits
    processors inside the batch, and min_p is the sampler's: concurrent requests share forwards, each answer
    is its answer alone, and each greedy one equals plain ``generate`` with the same options."""
    from transformers import LogitsProcessorList

    from kvstate.serve.params import OpenAIPenalties

    model, tokenizer = tiny
    server = make_server(model, tokenizer, max_batch=4)

    def answer(url: str, i: int) -> str:
        messages = [{"role": "user", "content": f"Say something about {TOPICS[i]}."}]
        r = client(url).chat.completions.create(model="tiny:llama", messages=messages, max_tokens=10,
                                                **{"temperature": 0, **PROCESSED[i][0]})
        return r.choices[0].message.content

    with live(server) as url:
        alone = [answer(url, i) for i in range(len(PROCESSED))]
        together: list = [None] * len(PROCESSED)
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, answer(url, i)))
                   for i in range(len(PROCESSED))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert server.runner.peak > 1, "the requests never shared a forward"
    assert together == alone
    renderer, changed = Renderer(tokenizer), []
    for i, (_, options) in enumerate(PROCESSED):
        if options is None:
            continue
        options = dict(options)
        penalties = options.pop("penalties", None)
        if penalties:
            options["logits_processor"] = LogitsProcessorList([OpenAIPenalties(*penalties)])
        ids = renderer.chat([{"role": "user", "content": f"Say something about {TOPICS[i]}."}]).ids
        assert alone[i] == reference(model, tokenizer, ids, 10, **options), i
        changed.append(alone[i] != reference(model, tokenizer, ids, 10))
    assert sum(changed) >= 3, changed  # the processors changed the answers


def test_batch_prepack_chooses_the_tiles_kernels_and_either_answers_as_plain_generate(tiny):
    """--batch-prepack on (the default) runs the tiles on prepacked weights, off on torch's F.linear; the prompts
    of a step are prefilled in 32-row tiles, or (--batch-prefill-rows 0) each in plain forwards: other bits,
    each as exact (greedy text equals plain generate's, concurrent answers equal alone)."""
    from kvstate.cli import _parser
    from kvstate.engine.batched.kernels import available

    model, tokenizer = tiny
    parse = _parser().parse_args
    assert parse(["serve"]).batch_prepack == "on" and parse(["serve", "--batch-prepack", "off"]).batch_prepack == "off"
    assert parse(["serve"]).batch_prefill_rows == 32
    assert parse(["serve", "--batch-prefill-rows", "0"]).batch_prefill_rows == 0
    for prepack, rows in ((True, 32), (False, 32), (True, 0)):  # 0: each prompt in plain forwards of its own
        server = make_server(model, tokenizer, max_batch=4, batch_prepack=prepack, batch_prefill_rows=rows)
        assert bool(server.runner.scheduler._packed.linears) is (prepack and available())
        assert server.runner.scheduler.settings.prefill_rows == server.runner.settings.prefill_rows == rows
        with live(server) as url:
            together: list = [None] * 4
            threads = [threading.Thread(target=lambda i=i, out=together: out.__setitem__(i, ask(client(url), 2 * i,
                                                                                                    False)))
                       for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            assert together == [ask(client(url), 2 * i, False) for i in range(4)], (prepack, rows)
        assert together[1][0] == ask_alone(model, tokenizer, 2), (prepack, rows)


def test_a_server_batches_by_default_on_a_gpu_and_serves_one_at_a_time_on_a_cpu(tiny):
    """--max-batch unset: the device's default (16 on CUDA, where a decode step reads the weights once whatever its
    rows; 1 on a CPU), and the canonical chunk the device's too (64 on a CPU without marks)."""
    from kvstate.cli import _parser
    from kvstate.serve.server import default_batch

    model, tokenizer = tiny
    assert _parser().parse_args(["serve"]).max_batch is None
    assert (default_batch("cuda"), default_batch("cpu"), default_batch("mps")) == (16, 1, 1)
    server = Server(model, tokenizer, "tiny:llama", Settings(turn_marks=False))
    assert server.max_batch == 1 == server.runner.settings.batching.max_batch and server.canonical_chunk == 64
    server.close()
    batched = Server(model, tokenizer, "tiny:llama", Settings(max_batch=4))
    assert batched.max_batch == 4 == batched.runner.settings.batching.max_batch
    batched.close()


SEEDED = [{"temperature": 0.9, "top_p": 0.95, "seed": 11}, {"temperature": 1.3, "seed": 5},
          {"temperature": 0.7, "top_p": 0.6, "seed": 2024, "extra_body": {"top_k": 20}},
          {"temperature": 1.0, "seed": 7, "logprobs": True, "top_logprobs": 2}]


def test_a_seeded_sampled_answer_is_the_same_at_max_batch_one_and_eight(tiny):
    """One seed rule: a request's seed draws what ``torch.manual_seed(seed); model.generate(...)`` draws (the
    sampler's generator seeded so, at every batch size), so a seeded sampled request gets the same answer from a
    one-at-a-time server and from a batched one serving it among others; both are plain generate's."""
    import torch

    model, tokenizer = tiny
    renderer = Renderer(tokenizer)

    def answer(url: str, i: int) -> tuple:
        messages = [{"role": "user", "content": f"Tell me about {TOPICS[i]}."}]
        r = client(url).chat.completions.create(model="tiny:llama", messages=messages, max_tokens=12, **SEEDED[i])
        lp = r.choices[0].logprobs
        return r.choices[0].message.content, None if lp is None else [t.model_dump() for t in lp.content]

    answers = {}
    for max_batch in (1, 8):
        server = make_server(model, tokenizer, max_batch=max_batch, batch_gather_ms=500)
        with live(server) as url:
            got: list = [None] * len(SEEDED)
            threads = [threading.Thread(target=lambda i=i, out=got: out.__setitem__(i, answer(url, i)))
                       for i in range(len(SEEDED))]
            fillers = [threading.Thread(target=lambda i=i: ask(client(url), 2 * i, False)) for i in range(3)]
            for t in [*threads, *fillers]:
                t.start()
            for t in [*threads, *fillers]:
                t.join(timeout=300)
            assert server.runner.peak == (1 if max_batch == 1 else 7), server.runner.peak
        answers[max_batch] = got
    # the same tokens; logprobs are each decode kernel's (one-row, or 16-row tiles: equal to rounding)
    tokens = {n: [(text, lp and [t["token"] for t in lp]) for text, lp in got] for n, got in answers.items()}
    assert tokens[1] == tokens[8]
    for i, body in enumerate(SEEDED):  # the oracle: plain generate, seeded with the global generator
        ids = torch.tensor([renderer.chat([{"role": "user", "content": f"Tell me about {TOPICS[i]}."}]).ids])
        torch.manual_seed(body["seed"])
        new = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=12,
                             temperature=body["temperature"], top_p=body.get("top_p", 1.0),
                             top_k=body.get("extra_body", {}).get("top_k", 0))[0, ids.shape[1]:]
        text = tokenizer.decode(new.tolist(), skip_special_tokens=True)
        assert answers[1][i][0] == text.split("\nUser:")[0], i
