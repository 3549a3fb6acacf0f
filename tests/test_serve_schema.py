"""The server's typed request schema, its 400s, opaque 500s and image bombs.

One table of hostile bodies (each must be a 400 in OpenAI's shape naming the field, and
nothing may run the model), then a 500 that must name only a request id, and images whose
header declares a decompression bomb. ``test_serve_fuzz.py`` fuzzes every route from the
published schema.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import struct
import zlib

import pytest
from PIL import Image
from tests.serving import live, make_server

from kvstate.serve import Server, Settings
from kvstate.serve.cli import image_processor, load
from kvstate.serve.params import CHAT_FIELDS, COMPLETION_FIELDS
from kvstate.serve.schema import ChatRequest, CompletionRequest
from tiny import count_forwards

MODEL = "tiny:llama"
HI = [{"role": "user", "content": "Hi"}]
CHAT, COMPLETE = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def served():
    model, tokenizer = load(MODEL)
    with live(make_server(model, tokenizer)) as url:
        yield model, url


def post(url: str, path: str, body: object) -> tuple[int, dict | str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()  # "\ud800" stays a JSON escape
    conn.request("POST", path, payload, {"Content-Type": "application/json"})
    response = conn.getresponse()
    text = response.read().decode()
    return response.status, json.loads(text) if response.getheader("content-type", "").startswith(
        "application/json") else text


CASES = {  # name -> (route, body fields besides model, the param the 400 names)
    "seed 2**63": (CHAT, {"messages": HI, "seed": 2**63}, "seed"),
    "seed 2**64": (CHAT, {"messages": HI, "seed": 2**64}, "seed"),
    "seed -(2**63)-1": (CHAT, {"messages": HI, "seed": -(2**63) - 1}, "seed"),
    "seed 1.5": (CHAT, {"messages": HI, "seed": 1.5}, "seed"),
    "prompt [10**12]": (COMPLETE, {"prompt": [10**12]}, "prompt"),
    "prompt [-1]": (COMPLETE, {"prompt": [-1]}, "prompt"),
    "prompt [vocab]": (COMPLETE, {"prompt": [128]}, "prompt"),
    "prompt [[2**31]]": (COMPLETE, {"prompt": [[2**31]]}, "prompt"),
    "lone surrogate in a message": (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, None),
    "lone surrogate in a text part": (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]}, None),
    "lone surrogate in a prompt": (COMPLETE, {"prompt": "x\ud83d"}, None),
    "lone surrogate in stop": (CHAT, {"messages": HI, "stop": ["\ud800"]}, None),
    "lone surrogate in a metadata key": (CHAT, {"messages": HI, "metadata": {"\ud800": "v"}}, None),
    "stream []": (CHAT, {"messages": HI, "stream": []}, "stream"),
    "stream {}": (CHAT, {"messages": HI, "stream": {}}, "stream"),
    "stream 'x'": (COMPLETE, {"prompt": "x", "stream": "x"}, "stream"),
    "stream 1": (CHAT, {"messages": HI, "stream": 1}, "stream"),
    "stream_options []": (CHAT, {"messages": HI, "stream_options": []}, "stream_options"),
    "stream_options {'a': 1}": (CHAT, {"messages": HI, "stream_options": {"a": 1}}, "stream_options.a"),
    "stream_options include_usage 'yes'": (CHAT, {"messages": HI, "stream": True,
                                                  "stream_options": {"include_usage": "yes"}},
                                           "stream_options.include_usage"),
    "user 5": (CHAT, {"messages": HI, "user": 5}, "user"),
    "user {}": (COMPLETE, {"prompt": "x", "user": {}}, "user"),
    "metadata 'x'": (CHAT, {"messages": HI, "metadata": "x"}, "metadata"),
    "metadata {'a': 1}": (CHAT, {"messages": HI, "metadata": {"a": 1}}, "metadata.a"),
    "metadata {'a': None}": (CHAT, {"messages": HI, "metadata": {"a": None}}, "metadata.a"),
    "tools {}": (CHAT, {"messages": HI, "tools": {}}, "tools"),
    "tools 'x'": (CHAT, {"messages": HI, "tools": "x"}, "tools"),
    "top_k 10**19": (CHAT, {"messages": HI, "top_k": 10**19}, "top_k"),
    "top_k 2.5": (CHAT, {"messages": HI, "top_k": 2.5}, "top_k"),
    "temperature '0.5'": (CHAT, {"messages": HI, "temperature": "0.5"}, "temperature"),
    "temperature true": (CHAT, {"messages": HI, "temperature": True}, "temperature"),
    "max_tokens 2**70": (CHAT, {"messages": HI, "max_tokens": 2**70}, "max_tokens"),
    "logit_bias key 10**30": (CHAT, {"messages": HI, "logit_bias": {str(10**30): 1}}, "logit_bias"),
    "message without role": (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    "message content 5": (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    "message part of type audio": (CHAT, {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
                                   "messages[0].content"),
    "an assistant turn with a tool call": (CHAT, {"messages": [*HI, {"role": "assistant", "content": None,
                                                                  "tool_calls": [{"id": "1"}]}]},
                                           "messages[1].tool_calls"),
    "model 5": (CHAT, {"messages": HI, "model": 5}, "model"),
    "no model": (CHAT, {"messages": HI, "model": None}, "model"),
    "unknown field": (CHAT, {"messages": HI, "frobnicate": 1}, "frobnicate"),
    "unknown field in a message": (CHAT, {"messages": [{"role": "user", "content": "x", "x": 1}]},
                                   "messages[0].x"),
    "a JSON array body": (CHAT, [1, 2], None),
    "an empty body": (CHAT, b"", None),
    "NaN temperature": (CHAT, b'{"model": "tiny:llama", "messages": [], "temperature": NaN}', None),
    "a seed of 5000 digits": (CHAT, b'{"model": "tiny:llama", "seed": ' + b"9" * 5000 + b"}", None),
    "stop ''": (CHAT, {"messages": HI, "stop": ""}, "stop"),
    "a stop string past --max-stop-length": (CHAT, {"messages": HI, "stop": "z" * 33}, "stop"),
    "a stop string of 5000 characters": (COMPLETE, {"prompt": "Count: one two", "max_tokens": 2,
                                                    "stop": ["z" * 5000]}, "stop"),
    "stop strings past --max-stop-strings": (CHAT, {"messages": HI, "stop": list("abcde")}, "stop"),
    "a logit_bias token outside the vocabulary": (COMPLETE, {"prompt": "x", "logit_bias": {"500": 1}},
                                                  "logit_bias"),
    "a body nested 100000 deep": (CHAT, b"[" * 100_000 + b"]" * 100_000, None),
    "a body that is not UTF-8": (CHAT, b'{"model": "\xff"}', None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_bodies_are_openai_400s(served, case):
    model, url = served
    route, fields, param = CASES[case]
    body = fields if not isinstance(fields, dict) else {"model": MODEL, **fields}
    if isinstance(body, dict) and body.get("model") is None:
        del body["model"]
    with count_forwards(model) as forwards:
        status, answer = post(url, route, body)
    assert status == 400, (status, answer)
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
    assert param is None or answer["error"]["param"] == param, answer
    assert "\n" not in answer["error"]["message"] and "Traceback" not in answer["error"]["message"]
    assert forwards[0] == 0


WORDED = {  # name -> (route, body fields besides model, the param, words the message must hold)
    "5 stop strings": (CHAT, {"messages": HI, "stop": list("abcde")}, "stop",
                       ["holds 5 strings", "at most 4", "--max-stop-strings"]),
    "a stop string of 5000 characters": (COMPLETE, {"prompt": "x", "stop": ["a", "z" * 5000]}, "stop",
                                         ["'stop[1]' is 5000 characters long", "at most 32", "--max-stop-length"]),
    "an empty stop string in a list": (CHAT, {"messages": HI, "stop": ["a", ""]}, "stop",
                                       ["'stop[1]'", "at least 1 character"]),
    "a number in a stop list": (CHAT, {"messages": HI, "stop": ["a", 1]}, "stop", ["'stop[1]'", "valid string"]),
    "a batch of texts": (COMPLETE, {"prompt": ["a", "b"]}, "prompt", ["a batch of 2 prompts", "one prompt"]),
    "a batch of token lists": (COMPLETE, {"prompt": [[5], [6], [7]]}, "prompt", ["a batch of 3 prompts"]),
    "an empty text in a prompt list": (COMPLETE, {"prompt": [""]}, "prompt", ["'prompt[0]'", "at least 1"]),
    "a NaN temperature": (COMPLETE, b'{"model": "tiny:llama", "prompt": "x", "temperature": NaN}', "temperature",
                          ["finite number"]),
    "an infinite top_p": (COMPLETE, b'{"model": "tiny:llama", "prompt": "x", "top_p": Infinity}', "top_p",
                          ["finite number"]),
    "a logit_bias token outside the vocabulary": (COMPLETE, {"prompt": "x", "logit_bias": {"500": 1}},
                                                  "logit_bias", ["token 500", "vocabulary [0, 128)"]),
}


@pytest.mark.parametrize("case", sorted(WORDED))
def test_a_400_names_the_problem_it_refuses(served, case):
    """The message says what is wrong with the value sent (not what another branch of the schema wanted), and a
    server limit names the flag that sets it."""
    model, url = served
    route, fields, param, words = WORDED[case]
    with count_forwards(model) as forwards:
        status, answer = post(url, route, fields if isinstance(fields, bytes) else {"model": MODEL, **fields})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert all(w in answer["error"]["message"] for w in words), answer["error"]["message"]
    assert forwards[0] == 0


def test_stop_limits_are_the_servers_flags_and_are_published():
    """``--max-stop-strings`` / ``--max-stop-length`` (``Limits``) set what a server takes, and its
    ``/openapi.json`` says so."""
    from kvstate.serve.params import Limits

    model, tokenizer = load(MODEL)
    stops = ["x" * 39 + str(i) for i in range(5)]
    with live(make_server(model, tokenizer, limits=Limits(max_stop_strings=8, max_stop_length=64))) as url:
        status, answer = post(url, COMPLETE, {"model": MODEL, "prompt": "x", "max_tokens": 2, "stop": stops})
        assert status == 200, answer
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("GET", "/openapi.json")
        stop = json.loads(conn.getresponse().read())["components"]["schemas"]["CompletionRequest"]["properties"]["stop"]
    array = next(branch for branch in stop["anyOf"] if branch.get("type") == "array")
    text = next(branch for branch in stop["anyOf"] if branch.get("type") == "string")
    assert (array["maxItems"], array["items"]["maxLength"], text["maxLength"]) == (8, 64, 64)


def test_valid_bodies_of_every_shape_are_answered(served):
    _, url = served
    replayed = {"role": "assistant", "content": None, "refusal": None, "tool_calls": []}
    bodies = [
        (CHAT, {"messages": [*HI, replayed, {"role": "developer", "content": [{"type": "text", "text": "Be brief"}],
                                             "name": "x"}], "seed": 2**63 - 1, "metadata": {"k": "v"}, "user": "u",
                "stream_options": {"include_usage": True}, "max_tokens": 2.0, "top_k": 3.0, "temperature": 1}),
        (COMPLETE, {"prompt": [[5, 6, 7]], "seed": -(2**63), "max_tokens": 2, "logit_bias": {"0007": -1}}),
        (COMPLETE, {"prompt": ["x"], "max_tokens": 2, "stream": False, "logprobs": 0, "echo": False}),
    ]
    for route, body in bodies:
        status, answer = post(url, route, {"model": MODEL, **body})
        assert status == 200, answer


def test_the_published_schema_is_the_one_enforced(served):
    _, url = served
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/openapi.json")
    schema = json.loads(conn.getresponse().read())
    chat = schema["components"]["schemas"]["ChatRequest"]
    assert chat["additionalProperties"] is False and set(chat["required"]) == {"model", "messages"}
    seed = next(s for s in chat["properties"]["seed"]["anyOf"] if s.get("type") == "integer")
    assert (seed["minimum"], seed["exclusiveMaximum"]) == (-(2**63), 2**63)  # an int64
    assert {"type": "boolean"} in chat["properties"]["stream"]["anyOf"]
    assert set(ChatRequest.model_fields) == CHAT_FIELDS and set(CompletionRequest.model_fields) == COMPLETION_FIELDS
    responses = schema["paths"][CHAT]["post"]["responses"]
    assert "422" not in json.dumps(schema) and {"200", "400", "401", "404", "413", "429", "500"} <= set(responses)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6])
def test_a_temperature_too_small_to_sample_is_greedy(served, temperature):
    _, url = served
    answers = []
    for t in (temperature, 0):
        status, answer = post(url, COMPLETE, {"model": MODEL, "prompt": "The cat", "max_tokens": 4, "temperature": t})
        assert status == 200, answer
        answers.append(answer["choices"][0]["text"])
    assert answers[0] == answers[1]


class Failing:
    """A forward hook that raises what a bug deep in the model would, with text that must stay private."""

    def __init__(self, model):
        self.handle = model.register_forward_hook(self)

    def __call__(self, *args):
        raise RuntimeError("secret-internal-detail at /srv/private/path")


@pytest.mark.parametrize("stream", [False, True])
def test_a_500_names_only_a_request_id_and_logs_the_details(caplog, stream):
    model, tokenizer = load(MODEL)
    failing = Failing(model)
    try:
        with caplog.at_level(logging.ERROR, logger="kvstate.serve"), live(make_server(model, tokenizer)) as url:
            status, answer = post(url, CHAT, {"model": MODEL, "messages": HI, "max_tokens": 2, "stream": stream})
    finally:
        failing.handle.remove()
    if stream:  # headers were sent: the error is one event, then [DONE]
        assert status == 200 and answer.rstrip().endswith("[DONE]")
        answer = json.loads(next(line[6:] for line in answer.splitlines() if '"error"' in line))
    else:
        assert status == 500
    message = answer["error"]["message"]
    assert answer["error"]["code"] == "internal_error" and "request id req_" in message
    assert "secret" not in message and "RuntimeError" not in message and "/srv" not in message
    request_id = message.split("request id ")[1].split(")")[0]
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert len(logged) == 1 and "secret-internal-detail" in str(logged[0].exc_info[1])


def _png(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width`` x ``height`` (its one data chunk holds a single row)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 4)) + \
        chunk(b"IEND", b"")


def _solid(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


IMAGES = {  # name -> (data URL, the status)
    "header declares 100000x100000 (Pillow's DecompressionBombError)": (_data_url(_png(100_000, 100_000)), 413),
    "header declares 7000x7000": (_data_url(_png(7000, 7000)), 413),
    "header declares 12000x12000 (Pillow's warning range)": (_data_url(_png(12_000, 12_000)), 413),
    "a PNG signature then garbage": (_data_url(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40), 400),
    "a 64x64 PNG cut after its header": (_data_url(_png(64, 64)[:40]), 400),
    "a 64x64 PNG with one row of pixels": (_data_url(_png(64, 64)), 400),
    "a 1x2000 image (an aspect ratio the processor refuses)": (_data_url(_solid(1, 2000)), 400),
}


@pytest.mark.parametrize("case", sorted(IMAGES))
def test_image_bombs_and_broken_images_are_4xx(case):
    url_data, expected = IMAGES[case]
    model, tokenizer = load("tiny:qwen2_vl")
    server = Server(model, tokenizer, "tiny:qwen2_vl", Settings(), image_processor=image_processor("tiny:qwen2_vl"))
    message = {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                           {"type": "image_url", "image_url": {"url": url_data}}]}
    with live(server) as url:
        status, answer = post(url, CHAT, {"model": "tiny:qwen2_vl", "messages": [message], "max_tokens": 2})
    assert status == expected, answer
    assert answer["error"]["param"].startswith("messages"), answer
