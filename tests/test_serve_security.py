"""``kvstate serve`` security and request validation: keys, namespaces, limits, no paths, OpenAI error shapes."""

from __future__ import annotations

import http.client
import json
import sys

import openai
import pytest
from tests.serving import chat_turn, client, live, make_server

from kvstate.serve.cli import load

MODEL = "tiny:llama"
HI = [{"role": "user", "content": "Hi there, who are you?"}]


@pytest.fixture(scope="module")
def tiny() -> tuple:
    return load("tiny:llama")


def _post(url: str, path: str, payload: bytes, headers: dict | None = None) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", path, payload, {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def test_api_keys_are_enforced(tiny):
    with live(make_server(*tiny, api_keys=("alpha",))) as url:
        with pytest.raises(openai.AuthenticationError) as wrong:
            client(url, "alpha2").chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
        assert wrong.value.body["code"] == "invalid_api_key"
        assert [m.id for m in client(url, "alpha").models.list()] == [MODEL]
        status, body = _post(url, "/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode())
        assert status == 401 and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("keys", [("",), (" ",), ("alpha", ""), (" alpha",)])
def test_an_empty_or_padded_key_is_refused(keys):
    """An empty key equals the empty token of a request without ``Authorization``: such a server would be open."""
    from kvstate.errors import InputError
    from kvstate.serve import Settings

    with pytest.raises(InputError, match="API keys"):
        Settings(api_keys=keys)


def test_key_namespaces_are_isolated_in_pool_and_store(tiny, tmp_path):
    settings = {"api_keys": ("alpha", "beta"), "store": str(tmp_path / "s"), "store_chunk_tokens": 4}
    with live(make_server(*tiny, **settings)) as url:
        alpha, beta = client(url, "alpha"), client(url, "beta")
        assert chat_turn(alpha, HI, stream=False)[1] == 0
        assert chat_turn(alpha, HI, stream=False)[1] > 0  # alpha's own repeat reuses
        assert chat_turn(beta, HI, stream=True)[1] == 0  # beta never sees alpha's pool entry or stored prefixes
    with live(make_server(*tiny, **settings)) as url:  # restarted: only the store remains
        assert chat_turn(client(url, "beta"), HI, stream=False)[1] > 0
        other = [{"role": "user", "content": "Hi there, who are you?!"}]
        with live(make_server(*tiny, **{**settings, "api_keys": ("gamma",)})) as url2:
            assert chat_turn(client(url2, "gamma"), other, stream=False)[1] == 0


def test_oversize_requests_are_rejected(tiny):
    with live(make_server(*tiny, max_request_bytes=2000, limits=_limits(prompt=40, new=64))) as url:
        api = client(url)
        big = [{"role": "user", "content": "x" * 5000}]
        status, body = _post(url, "/v1/chat/completions", json.dumps({"model": MODEL, "messages": big}).encode())
        assert status == 413 and "over the limit" in body["error"]["message"]
        with pytest.raises(openai.BadRequestError) as long:
            api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * 100}])
        assert long.value.body["code"] == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as many:
            api.chat.completions.create(model=MODEL, messages=HI, max_tokens=65)
        assert many.value.body["param"] == "max_tokens"


def _limits(prompt: int, new: int):
    from kvstate.serve.params import Limits

    return Limits(max_prompt_tokens=prompt, max_new_tokens=new, default_max_tokens=8)


@pytest.mark.parametrize("body, status, param", [
    ({"messages": HI, "n": 2}, 400, "n"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),  # logprobs: at most 20
    ({"messages": HI, "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": HI, "frobnicate": 1}, 400, "frobnicate"),
    ({"messages": HI, "temperature": 3}, 400, "temperature"),
    ({"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"messages": HI, "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
])
def test_bad_requests_get_openai_errors(tiny, body, status, param):
    with live(make_server(*tiny)) as url:
        code, answer = _post(url, "/v1/chat/completions", json.dumps({"model": MODEL, **body}).encode())
    assert code == status and answer["error"]["param"] == param and answer["error"]["message"]


def test_invalid_json_and_unknown_model(tiny):
    with live(make_server(*tiny)) as url:
        assert _post(url, "/v1/chat/completions", b"{not json")[0] == 400
        assert _post(url, "/v1/completions", json.dumps({"model": MODEL, "prompt": [999]}).encode())[0] == 400
        with pytest.raises(openai.NotFoundError) as info:
            client(url).chat.completions.create(model="gpt-4o", messages=HI)
        assert info.value.body["code"] == "model_not_found"


def test_path_like_inputs_never_touch_the_filesystem(tiny, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    opened: list[str] = []

    def audit(event: str, args: tuple) -> None:
        if event in ("open", "os.listdir", "os.scandir") and args and "secret" in str(args[0]):
            opened.append(f"{event} {args[0]}")

    sys.addaudithook(audit)  # hooks cannot be removed; this one only records paths under this test's folder
    path = str(secret)
    requests = [
        {"model": path, "messages": HI},
        {"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "file://" + path}}]}]},
        {"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": path}}]}]},
        {"model": MODEL, "messages": [{"role": "user", "content": path}], "max_tokens": 2, "stop": [path],
         "user": path},
        {"model": MODEL, "prompt": path, "max_tokens": 2},
    ]
    from kvstate.serve.params import Limits

    with live(make_server(*tiny, limits=Limits(max_stop_length=len(path)))) as url:  # the path as a stop, too
        statuses = [_post(url, "/v1/chat/completions" if "messages" in r else "/v1/completions",
                          json.dumps(r).encode())[0] for r in requests]
    assert statuses == [404, 400, 400, 200, 200]
    assert opened == []


def test_unknown_routes_get_openai_errors_and_few_metric_labels(tiny):
    with live(make_server(*tiny)) as url:
        status, body = _post(url, "/v1/nope/" + "x" * 50, b"{}")
        assert status == 404 and body["error"]["type"] == "invalid_request_error"
        assert _post(url, "/v1/models/" + "y" * 30, b"{}")[0] == 405
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
    assert "xxxx" not in metrics and "yyyy" not in metrics and 'endpoint="unmatched",status="404"' in metrics


# transformers refuses this only when generate builds its criteria: a stop string no token of the tokenizer spells
# (found by schemathesis; a logit bias outside the vocabulary, found likewise, is checked with the request now)
@pytest.mark.parametrize("option", [{"stop": ["\u2603"]}], ids=["stop"])
def test_options_transformers_rejects_late_are_a_400_and_commit_nothing(tiny, option):
    server = make_server(*tiny)
    with live(server) as url:
        chat_turn(client(url), HI, stream=False)
        server.runner.drain()  # the reply's settled state joins the pool after the reply; then nothing more may
        pooled = list(server.pool._states.values())
        request = {"model": MODEL, "messages": [*HI, {"role": "user", "content": "More"}], "max_tokens": 2,
                   **option}
        status, body = _post(url, "/v1/chat/completions", json.dumps(request).encode())
        assert status == 400 and body["error"]["message"].startswith("invalid generation options")
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps({**request, "stream": True}),
                     {"Content-Type": "application/json"})
        events = conn.getresponse().read().decode()  # streaming: headers are sent, the error is an event
        assert '"message":"invalid generation options' in events and events.rstrip().endswith("[DONE]")
        server.runner.drain()
        assert list(server.pool._states.values()) == pooled  # nothing of the failed calls was kept
