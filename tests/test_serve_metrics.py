"""``GET /metrics``: scraped with prometheus_client's own parser after real requests, the counts must be the
requests' own (their usage blocks, their finish reasons), under vLLM's names with kvstate's prefix."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tests.serving import live, make_server, metric

from kvstate import PrefixStore
from kvstate.serve.cli import load

MODEL = "tiny:llama"
HI = [{"role": "user", "content": "Hello there, metrics!"}]
NO_END = {"0": -100, "1": -100, "2": -100}  # pad, bos, eos: keeps a random tiny model talking


@pytest.fixture(scope="module")
def tiny() -> tuple:
    return load(MODEL)


def _request(url: str, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request(method, path, None if body is None else json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read().decode()


def _usage(status_text: tuple[int, str]) -> dict:
    """The usage and finish reason of a JSON answer, or of a stream's events."""
    status, text = status_text
    assert status == 200, text
    if text.startswith("data: "):
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        finish = next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and
                      c["choices"][0]["finish_reason"])
        return {**chunks[-1]["usage"], "finish_reason": finish}
    answer = json.loads(text)
    return {**answer["usage"], "finish_reason": answer["choices"][0]["finish_reason"]}


def _wait_idle(server, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while server.runner.pending and time.monotonic() < deadline:
        time.sleep(0.02)
    server.runner.drain()


@pytest.mark.parametrize("max_batch", [1, 4], ids=["one-at-a-time", "batched"])
def test_metrics_count_what_the_requests_did(tiny, tmp_path, max_batch):
    model, tokenizer = tiny
    server = make_server(model, tokenizer, store=str(tmp_path / "store"), store_chunk_tokens=8, max_batch=max_batch)
    chat = {"model": MODEL, "max_tokens": 5, "temperature": 0}
    with live(server) as url:
        turn = _usage(_request(url, "POST", "/v1/chat/completions", {**chat, "messages": HI}))
        again = [*HI, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "And now?"}]
        usages = [turn, _usage(_request(url, "POST", "/v1/chat/completions", {
            **chat, "messages": again, "stream": True, "stream_options": {"include_usage": True}})),
            _usage(_request(url, "POST", "/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 1,
                                                              "temperature": 0})),
            _usage(_request(url, "POST", "/v1/completions", {"model": MODEL, "prompt": "Once upon a", "stop": "e",
                                                              "max_tokens": 30, "temperature": 0}))]
        assert _request(url, "POST", "/v1/chat/completions", {**chat, "messages": HI, "n": 2})[0] == 400
        _wait_idle(server)
        status, text = _request(url, "GET", "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}  # what a Prometheus scraper reads
    assert all(name.startswith("kvstate:") for name in families) and "_created" not in text
    types = {"time_to_first_token_seconds": "histogram", "time_per_output_token_seconds": "histogram",
             "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
             "request_inference_time_seconds": "histogram", "request_cached_tokens": "histogram",
             "request_prompt_tokens": "histogram", "request_prefill_kv_computed_tokens": "histogram",
             "num_requests_running": "gauge", "num_requests_waiting": "gauge", "pool_states": "gauge",
             "pool_bytes": "gauge", "store_hits": "gauge", "prompt_tokens": "counter", "requests": "counter",
             "generation_tokens": "counter", "prompt_tokens_cached": "counter", "request_success": "counter"}
    assert {name: families["kvstate:" + name].type for name in types} == types

    def total(key: str) -> int:
        return sum(u[key] for u in usages)

    assert metric(text, "kvstate:requests_total", endpoint="/v1/chat/completions", status="200") == 2
    assert metric(text, "kvstate:requests_total", endpoint="/v1/completions", status="200") == 2
    assert metric(text, "kvstate:requests_total", endpoint="/v1/chat/completions", status="400") == 1
    for reason in {u["finish_reason"] for u in usages}:
        assert metric(text, "kvstate:request_success_total", finished_reason=reason) == \
            sum(u["finish_reason"] == reason for u in usages), reason
    assert metric(text, "kvstate:prompt_tokens_total", model_name=MODEL) == total("prompt_tokens")
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0  # the second turn reused the first
    assert metric(text, "kvstate:prompt_tokens_cached_total") == cached
    assert metric(text, "kvstate:generation_tokens_total") == total("completion_tokens")
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens", "request_cached_tokens"):
        assert metric(text, f"kvstate:{name}_count") == len(usages), name
        assert metric(text, f"kvstate:{name}_bucket", le="+Inf") == len(usages), name
    assert metric(text, "kvstate:time_per_output_token_seconds_count") == \
        sum(u["completion_tokens"] > 1 for u in usages)
    assert metric(text, "kvstate:request_prompt_tokens_sum") == total("prompt_tokens")
    assert metric(text, "kvstate:request_cached_tokens_sum") == cached
    assert metric(text, "kvstate:request_prefill_kv_computed_tokens_sum") == total("prompt_tokens") - cached
    assert metric(text, "kvstate:request_generation_tokens_sum") == total("completion_tokens")
    assert 0 < metric(text, "kvstate:time_to_first_token_seconds_sum") <= \
        metric(text, "kvstate:e2e_request_latency_seconds_sum")
    assert metric(text, "kvstate:num_requests_running") == metric(text, "kvstate:num_requests_waiting") == 0
    assert metric(text, "kvstate:queue_depth") == 0
    assert (metric(text, "kvstate:pool_states"), metric(text, "kvstate:pool_bytes")) == \
        (len(server.pool), server.pool.nbytes)
    stats = PrefixStore(tmp_path / "store").stats()
    assert (metric(text, "kvstate:store_hits"), metric(text, "kvstate:store_misses")) == \
        (stats["hits"], stats["misses"]) and stats["misses"] > 0


@pytest.mark.parametrize("max_batch", [1, 2], ids=["one-at-a-time", "batched"])
def test_running_and_waiting_requests_are_gauges_of_the_queue(tiny, max_batch):
    """A long stream runs; with one more request than the model takes at once, one waits."""
    model, tokenizer = tiny
    server = make_server(model, tokenizer, max_batch=max_batch)
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Go."}], "max_tokens": 2000, "temperature": 0,
            "stream": True, "stop": None, "logit_bias": NO_END}
    with live(server) as url:
        host, port = url.removeprefix("http://").split(":")
        streams = []
        for i in range(max_batch):  # prompts of their own: a shared one would wait for the first one's prefill
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            body = {**long, "messages": [{"role": "user", "content": f"Go {i}."}]}
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200 and response.readline()
            streams.append(conn)
        queued = threading.Thread(target=_request, args=(url, "POST", "/v1/chat/completions",
                                                          {**long, "stream": False, "max_tokens": 2}))
        queued.start()
        deadline, seen = time.monotonic() + 60, None
        while seen != (max_batch, 1, max_batch + 1) and time.monotonic() < deadline:  # admitted at a step's end
            text = _request(url, "GET", "/metrics")[1]
            seen = tuple(metric(text, "kvstate:" + name) for name in ("num_requests_running",
                                                                       "num_requests_waiting", "queue_depth"))
            time.sleep(0.05)
        assert seen == (max_batch, 1, max_batch + 1), seen
        for conn in streams:
            conn.close()
        queued.join(timeout=60)
        _wait_idle(server)
        text = _request(url, "GET", "/metrics")[1]
    assert metric(text, "kvstate:num_requests_running") == metric(text, "kvstate:num_requests_waiting") == 0
    assert metric(text, "kvstate:request_success_total") == 1  # the cancelled streams completed nothing


def test_two_servers_in_one_process_count_apart(tiny):
    """Each server has a registry of its own: nothing is shared, nothing collides."""
    model, tokenizer = tiny
    with live(make_server(model, tokenizer)) as a, live(make_server(model, tokenizer)) as b:
        assert _request(a, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})[0] == 200
        first, second = _request(a, "GET", "/metrics")[1], _request(b, "GET", "/metrics")[1]
    assert metric(first, "kvstate:requests_total", endpoint="/v1/completions") == 1
    assert metric(second, "kvstate:requests_total", endpoint="/v1/completions") == 0
    assert metric(first, "kvstate:e2e_request_latency_seconds_count") == 1
    assert metric(second, "kvstate:e2e_request_latency_seconds_count") == 0
