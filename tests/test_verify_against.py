"""``kvstate verify --against``: planted faults are caught by their scenario and named.

The servers under test (``tests/fault_servers.py``) are OpenAI-compatible apps over a tiny real
model with a real block prefix cache, written apart from kvstate; each plants one fault. The cold
reference is the same app with its cache off, so a correct cache is bitwise the cold run.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from tests.fault_servers import Engine, serve, tiny_llama
from tests.serving import live

from kvstate.cli import main
from kvstate.errors import AgainstError
from kvstate.serve import Server, Settings
from kvstate.serve.cli import load
from kvstate.verify.against import Options, run_against
from kvstate.verify.against.client import Call, Client, hit_tokens

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "against.schema.json").read_text())
# the fault servers are bitwise by construction (a correct hit runs the cold chunks), so no drift is allowed
SMALL = dict(max_tokens=4, long_chars=700, clients=4, rounds=1, key_lengths=(32,), floor_repeats=1,
             logprob_tolerance=0.0)
HIT_SCENARIOS = {"repeat", "shared-prefix", "multi-turn", "edited-turn", "image", "long", "streaming", "concurrent"}
FULL_HITS = {"repeat", "image", "long", "streaming"}  # the scenarios with a full-hit probe

# fault, scenarios that must fail (exactly, or at least with "+"), scenarios that must pass, the diagnosis
CASES = [
    ("refeed-last", FULL_HITS, {"shared-prefix", "multi-turn", "edited-turn", "concurrent"}, "token boundary"),
    ("drop-last", FULL_HITS, {"shared-prefix", "multi-turn", "edited-turn", "concurrent"}, "token boundary"),
    ("stale-key", {"+", "shared-prefix", "edited-turn"}, {"repeat", "multi-turn"}, "stale or colliding key"),
    ("media-key", {"image"}, HIT_SCENARIOS - {"image"}, "media missing from the key"),
    ("leak", {"concurrent"}, HIT_SCENARIOS - {"concurrent"}, "cross-request contamination"),
    ("shift-positions", {"+", "repeat", "shared-prefix", "multi-turn", "long"}, set(),
     "positions or K/V wrong after any hit"),
]


@pytest.fixture(scope="module")
def tiny() -> tuple:
    return tiny_llama()


@pytest.fixture(scope="module")
def cold(tiny):
    with serve(Engine(*tiny, cache=False)) as url:
        yield url


def _verdicts(report) -> dict[str, str]:
    return {s.name: s.verdict for s in report.scenarios}


@pytest.mark.parametrize(("fault", "failing", "passing", "branch"), CASES, ids=[c[0] for c in CASES])
def test_fault_is_caught_by_its_scenario_and_named(tiny, cold, fault, failing, passing, branch):
    with serve(Engine(*tiny, fault=fault)) as url:
        report = run_against(Options(url, cold_url=cold, **SMALL))
    verdicts = _verdicts(report)
    failed = {name for name, v in verdicts.items() if v == "fail"}
    assert report.exit_code == 1, report.table()
    if "+" in failing:
        assert failing - {"+"} <= failed, report.table()
    else:
        assert failed == failing, report.table()
    assert all(verdicts[name] == "pass" for name in passing), report.table()
    # one finding, the fault's own (the control probes agree: the servers are twins)
    assert len(report.findings) == 1 and report.findings[0].branch.startswith(branch), report.table()


def test_a_correct_cache_passes_with_every_warm_request_a_hit(tiny, cold):
    with serve(Engine(*tiny)) as url:
        report = run_against(Options(url, cold_url=cold, **SMALL))
    assert report.exit_code == 0 and report.outcome == "consistent", report.table()
    assert report.logprobs and report.floor.drift == 0.0, "both servers return logprobs; cold repeats are bitwise"
    for s in report.scenarios:
        if s.name in HIT_SCENARIOS:
            assert s.verdict == "pass" and s.hits == len(s.scored) > 0, report.table()
            assert all(p.drift == 0.0 for p in s.probes), f"{s.name}: a correct block cache is bitwise the cold run"
    assert _verdicts(report)["restart"] == "skipped" and not report.findings


def test_a_server_without_a_cache_is_inconclusive_never_a_pass(tiny, cold):
    with serve(Engine(*tiny, cache=False)) as url:
        report = run_against(Options(url, cold_url=cold, **SMALL, scenarios=("repeat", "shared-prefix", "streaming")))
    assert report.exit_code == 3 and report.outcome == "inconclusive", report.table()
    assert {s.verdict for s in report.scenarios} == {"inconclusive"}
    assert all(p.hit == 0 and p.agree for s in report.scenarios for p in s.probes)


@pytest.mark.parametrize(("fault", "use_reset", "mode", "code"), [
    (None, True, "reset", 0),  # the server's own POST /reset_prefix_cache gives the cold answers
    ("shift-positions", True, "reset", 1),
    (None, False, "first-occurrence", 0),  # each request's first send is the reference
    ("refeed-last", False, "first-occurrence", 1),
])
def test_without_a_cold_server(tiny, fault, use_reset, mode, code):
    with serve(Engine(*tiny, fault=fault)) as url:
        report = run_against(Options(url, use_reset=use_reset, **SMALL, scenarios=("repeat", "shared-prefix")))
    assert report.mode == mode and report.exit_code == code, report.table()
    assert all(s.hits == len(s.scored) for s in report.scenarios), report.table()


def test_servers_that_refuse_images_or_a_system_message(tiny):
    with serve(Engine(*tiny), images=False, system_role=False) as url, \
            serve(Engine(*tiny, cache=False), images=False, system_role=False) as cold_url:
        report = run_against(Options(url, cold_url=cold_url, **SMALL, scenarios=("multi-turn", "image")))
    assert report.exit_code == 0, report.table()  # the system prompt travels in the first user turn
    assert _verdicts(report) == {"multi-turn": "pass", "image": "skipped"}
    assert "this model takes no images" in report.scenarios[1].skipped


def test_a_strict_server_without_a_models_route_needs_the_model_name(tiny, capsys):
    with serve(Engine(*tiny), strict=True) as url, serve(Engine(*tiny, cache=False), strict=True) as cold_url:
        assert main(["verify", "--against", url, "--cold", cold_url]) == 2
        assert "lists no models" in capsys.readouterr().err
        report = run_against(Options(url, cold_url=cold_url, model="tiny-fault", **SMALL, scenarios=("streaming",)))
    # streamed without stream_options: no usage chunk, so no hit can be seen: inconclusive, never a pass
    assert report.exit_code == 3 and all(p.agree and p.hit is None for p in report.scenarios[0].probes)


def test_cli_json_follows_the_schema_and_markdown_is_written(tiny, cold, tmp_path, capsys):
    markdown = tmp_path / "report.md"
    with serve(Engine(*tiny, fault="refeed-last")) as url:
        code = main(["verify", "--against", url, "--cold", cold, "--json", "--markdown", str(markdown),
                     "--scenarios", "repeat,shared-prefix", "--new-tokens", "4", "--served-model", "tiny-fault"])
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, SCHEMA)
    assert code == 1 and data["exit_code"] == 1 and data["outcome"] == "divergence"
    assert [s["verdict"] for s in data["scenarios"]] == ["fail", "pass"]
    text = markdown.read_text()
    assert "| repeat |" in text and "token boundary" in text


def test_kvstate_serve_against_its_no_reuse_twin_is_consistent_with_hits_everywhere(capsys):
    model, tokenizer = load("tiny:llama")
    with live(Server(model, tokenizer, "tiny:llama", Settings())) as warm, \
            live(Server(model, tokenizer, "tiny:llama", Settings(reuse=False))) as cold:
        twin = Client(cold, model="tiny:llama")
        call = Call(messages=({"role": "user", "content": "Hello " * 100},), max_tokens=2)
        assert [twin.send(call).cached for _ in range(2)] == [0, 0], "--no-reuse reports no cached tokens"
        code = main(["verify", "--against", warm, "--cold", cold, "--json", "--new-tokens", "4", "--long-chars",
                     "1500", "--clients", "3", "--rounds", "1"])
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, SCHEMA)
    assert code == 0 and data["outcome"] == "consistent", json.dumps(data["scenarios"], indent=1)[:3000]
    for s in data["scenarios"]:
        if s["skipped"] is None:
            assert s["verdict"] == "pass" and s["hits"] == s["probes_scored"] > 0, s
    assert {s["name"] for s in data["scenarios"] if s["skipped"]} == {"image", "restart"}  # text model; no command


@pytest.mark.parametrize(("argv", "message"), [
    (["verify", "--against", "ftp://host"], "not a server URL"),
    (["verify", "--against", "http://127.0.0.1:9"], "cannot reach"),
    (["verify", "--cold", "http://127.0.0.1:9"], "pass it with --against"),
    (["verify", "--against", "http://127.0.0.1:9", "--inject", "refeed-last"], "--inject applies to the local"),
    (["verify", "--against", "http://127.0.0.1:9", "--timeout", "0"], "expected seconds"),
    (["verify", "--against", "http://127.0.0.1:9", "--scenarios", "nope"], "unknown scenario"),
    (["verify", "--against", "http://127.0.0.1:9", "--clients", "40"], "--clients is at most 16"),
    (["serve", "--no-reuse", "--store", "/tmp/x"], "--no-reuse runs every request cold"),
])
def test_usage_errors_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        raise SystemExit(main(argv))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(("payload", "expected"), [
    ({"usage": {"prompt_tokens_details": {"cached_tokens": 48}}}, 48),  # OpenAI, vLLM, SGLang, kvstate serve
    ({"usage": {"prompt_tokens": 9}, "timings": {"cache_n": 7, "prompt_n": 2}}, 7),  # llama.cpp server
    ({"usage": {"prompt_cache_hit_tokens": 64}}, 64),  # DeepSeek-style
    ({"meta_info": {"cached_tokens": 5}}, 5),  # SGLang native
    ({"tokens_cached": 12}, 12),  # llama.cpp /completion
    ({"usage": {"prompt_tokens": 9, "prompt_tokens_details": None}}, None),  # no hit field: inconclusive
    ({"usage": {"prompt_tokens_details": {"cached_tokens": True}}}, None),  # not a count
])
def test_hit_fields_of_each_engine(payload, expected):
    assert hit_tokens(payload) == expected


def test_restart_command_runs_between_primer_and_warm_request(tiny, cold, tmp_path):
    marker = tmp_path / "restarted"
    with serve(Engine(*tiny)) as url:
        report = run_against(Options(url, cold_url=cold, **SMALL, scenarios=("restart",),
                                     restart_cmd=f"touch {marker}", restart_wait=30))
        assert marker.exists() and report.exit_code == 0, report.table()  # this server keeps its cache
        with pytest.raises(AgainstError, match="--restart-cmd failed"):
            run_against(Options(url, cold_url=cold, **SMALL, scenarios=("restart",), restart_cmd="exit 3"))
