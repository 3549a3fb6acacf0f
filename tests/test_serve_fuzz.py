"""Schemathesis fuzzes every route of ``kvstate serve`` from its own ``/openapi.json``.

Bodies that fit the schema (half of them naming the served model, with ``max_tokens`` kept
small and the fields kvstate refuses left out, so that they generate) and, on the routes
that take a body, bodies that break it. Acceptance: no 5xx, and every status, content type
and response body (each server-sent event included) is one the schema documents. The server
bounds prompts and answers so that a run stays short on the tiny model.
"""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from tests.serving import live, make_server

from kvstate.serve.cli import load
from kvstate.serve.params import Limits

MODEL = "tiny:llama"
ROUTES = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"),
          ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
REFUSED = ("n", "echo", "suffix", "best_of", "tools", "tool_choice", "response_format", "modalities")
EXAMPLES = 60  # per route and mode: about 6 s in all on the tiny model


@pytest.fixture(scope="module")
def api():
    model, tokenizer = load(MODEL)
    limits = Limits(max_prompt_tokens=64, max_new_tokens=4, default_max_tokens=4)
    with live(make_server(model, tokenizer, limits=limits, pool_bytes=1 << 20)) as url:
        yield url, schemathesis.openapi.from_dict(requests.get(url + "/openapi.json", timeout=30).json())


def _served(pair):
    """Half the bodies ask the served model for a short answer, so the generation path is fuzzed too."""
    case, ours = pair
    if ours and isinstance(case.body, dict):
        case.body["model"] = MODEL
        for name in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                case.body[name] = 1 + value % 4
        for name in REFUSED:
            case.body.pop(name, None)
    return case


def test_the_schema_lists_every_route(api):
    _, schema = api
    assert sorted((op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()) == sorted(ROUTES)


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_route_answers_as_its_schema_says(api, method, path):
    url, schema = api
    operation = schema[path][method]
    statuses: dict[int, int] = {}
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if method == "POST" else [])
    for mode in modes:
        cases = st.tuples(operation.as_strategy(generation_mode=mode), st.booleans()).map(_served)

        # derandomized: the same cases every run, so "the fuzz reached generation" cannot fail by chance
        # (a random run once drew no 200 among 120 cases)
        @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate], derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases)
        def fuzz(case):
            response = case.call_and_validate(base_url=url, checks=CHECKS)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        fuzz()
    assert statuses and max(statuses) < 500, statuses
    if method == "POST":  # the fuzz reached generation, and refusals
        assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses
