"""The control matrix: every family passes, plain rows reproduce the seed, faults are diagnosed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from kvstate._compat.scan import available as scan_available
from kvstate.adapters import supported_model_types
from kvstate.cli import main
from kvstate.errors import InputError
from kvstate.testing.tiny import QWEN_VL, RECURRENT
from kvstate.verify import verify
from tiny import prompt, tiny_model

SCHEMA = json.loads((Path(__file__).parent.parent / "docs" / "verify.schema.json").read_text())
PURE_RECURRENT = ("mamba", "mamba2", "rwkv")  # no attention: generate never slices, so no mask contract to break
# transformers 5.24's generate() cannot take these cache classes at all, so every plain resume
# crashes; kvstate feeds them through forward and must still pass every row of its own
PLAIN_GENERATE_REFUSES_CACHE = {"xlstm": "'xLSTMCache' object has no attribute 'is_compileable'"}


# Plain transformers' own behaviour moves between minors (scripts/version_window.py found it): 5.18 - 5.22's
# RecurrentGemma keeps the unprocessed token when explicit positions come without the full mask, where the
# other minors drop it as the long seed found; from 5.25 every hybrid family's generate keeps it (its cache
# reports the length of its recurrent layers), and Jamba's keeps it with neither mask nor positions. kvstate's rows
# do not depend on any of it.
NEWEST = ((5, 25), (99, 0))
POSITIONS_SUFFICE = {"recurrent_gemma": (((5, 18), (5, 22)), NEWEST), "lfm2": (NEWEST,), "minimax": (NEWEST,),
                     "qwen3_next": (NEWEST,), "jamba": (NEWEST,)}
NEITHER_SUFFICES = {"jamba": (NEWEST,)}


def _within(spans) -> bool:
    from kvstate._compat import versions

    return any(low <= versions.minor(versions.installed()) <= high for low, high in spans)


def _positions_suffice(arch):
    return _within(POSITIONS_SUFFICE.get(arch, ()))


def rows_by_name(report):
    return {row.name: row for row in report.rows}


@pytest.mark.parametrize("arch", supported_model_types())
def test_every_family_passes_and_plain_rows_show_the_seed(arch):
    report = verify(tiny_model(arch), prompt(24), new_tokens=4, fresh=lambda: tiny_model(arch))
    assert report.ok, report.table()
    rows = rows_by_name(report)
    if arch in PLAIN_GENERATE_REFUSES_CACHE:
        assert rows["plain: mask only"].verdict == "crashes"
        assert PLAIN_GENERATE_REFUSES_CACHE[arch] in rows["plain: mask only"].error
    elif arch == "mamba" and not scan_available("transformers.models.mamba.modeling_mamba"):
        # transformers 5.14's Mamba (the one without a selective-scan function) resumes generate() from a
        # cache wrongly on its own: the plain row drifts there, while kvstate's rows (never on that path) pass
        assert rows["plain: mask only"].verdict in ("drifts", "crashes")
    else:
        assert rows["plain: mask only"].matches  # the cache itself is fine on the same instance
    if arch not in PURE_RECURRENT and not _within(NEITHER_SUFFICES.get(arch, ())):
        assert rows["plain: neither"].verdict in ("crashes", "drifts")
        if not _positions_suffice(arch):
            assert rows["plain: positions only"].verdict in ("crashes", "drifts")
    if arch in QWEN_VL:
        assert rows["plain: image prefix, fresh instance, mask only"].verdict == "drifts"
        assert rows["kvstate: image prefix, fresh instance"].matches
        # the seed's own table on a video prefix: the cache variants pass, plain drifts
        # on a fresh instance (rope_deltas stay on the old one) and needs the full mask
        video = [r for r in report.rows if r.name.startswith(("kvstate: video", "plain: video"))]
        assert {r.name for r in video if r.group == "kvstate"} >= {
            "kvstate: video, original state", "kvstate: video, rebuilt from raw K/V", "kvstate: video, saved + loaded",
            "kvstate: video, fresh instance"}
        assert all(r.matches for r in video if r.group == "kvstate")
        assert rows["plain: video, fresh instance, mask only"].verdict == "drifts"
        assert rows["plain: video, mask only"].matches
        assert rows["plain: video, neither"].verdict in ("crashes", "drifts")
    if arch not in RECURRENT:
        assert rows["kvstate: left-padded batch"].matches


def skip_without_a_floor(report) -> None:
    """transformers 5.14's generate cannot prefill Qwen-VL in chunks, so no bf16 floor exists to judge the
    rows that are not on the canonical schedule against (the report says so); 5.24's can."""
    if report.dtype != "float32" and not report.floor.splits:
        floor = next(line for line in report.table().splitlines() if line.startswith("noise floor"))
        pytest.skip(f"no noise floor measurable on transformers {report.environment['transformers']} for "
                    f"{report.model}: {floor}")


@pytest.mark.parametrize("fault,arch,branch", [
    ("corrupt-k", "llama", "K/V reconstruction"),
    ("drop-mask", "gemma3_text", "resume-input contract (full mask)"),
    ("refeed-last", "qwen3", "token boundary"),
    ("zero-rope-deltas", "qwen3_vl", "model-side state outside K/V"),
    ("shift-positions", "mistral", "logical positions"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_planted_faults_name_their_branch(fault, arch, branch, dtype):
    """In bfloat16 too: the floor widens, but a planted fault breaks bitwise equality with the
    cold run, so it is still caught and named."""
    report = verify(tiny_model(arch).to(dtype), prompt(24), new_tokens=4, fresh=lambda: tiny_model(arch).to(dtype),
                    fault=fault)
    skip_without_a_floor(report)
    assert not report.ok
    kvstate_findings = [f for f in report.findings if f.subject == "kvstate"]
    assert [f.branch for f in kvstate_findings] == [branch], report.table()


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_vl"])
def test_bfloat16_passes_bitwise_and_states_its_floor(arch):
    report = verify(tiny_model(arch).to(torch.bfloat16), prompt(24), new_tokens=4,
                    fresh=lambda: tiny_model(arch).to(torch.bfloat16))
    skip_without_a_floor(report)
    assert report.ok, report.table()
    assert report.floor is not None and report.floor.chunk > 0 and "noise floor" in report.table()
    canonical = [r for r in report.rows if r.group == "kvstate" and r.bitwise is not None]
    assert len(canonical) >= 8 and all(r.bitwise for r in canonical)


def test_fault_that_cannot_apply_is_refused():
    with pytest.raises(InputError, match="multimodal"):
        verify(tiny_model("llama"), prompt(12), fault="zero-rope-deltas", fresh=lambda: tiny_model("llama"))
    with pytest.raises(InputError, match="unknown fault"):
        verify(tiny_model("llama"), prompt(12), fault="nonsense")


def test_json_validates_and_markdown_is_a_table(tmp_path, capsys):
    md = tmp_path / "report.md"
    assert main(["verify", "--model", "tiny:gemma3_text", "--quick", "--json", "--backends", "eager,sdpa",
                 "--markdown", str(md)]) == 0
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, SCHEMA)
    assert [r["backend"] for r in data["reports"]] == ["eager", "sdpa"] and data["ok"]
    table = [line for line in md.read_text().splitlines() if line.startswith("|")]
    assert table[0].startswith("| group | check |") and set(table[1]) <= set("|-")
    columns = [len(re.findall(r"(?<!\\)\|", line)) for line in table]  # escaped \| is cell text
    assert len(set(columns)) == 1 and len(table) > 20


def test_exit_code_follows_kvstate_rows_only(capsys):
    assert main(["verify", "--model", "tiny:llama", "--quick"]) == 0  # plain rows crash, run passes
    out = capsys.readouterr().out
    assert "crashes" in out and "all kvstate paths match" in out
    assert main(["verify", "--model", "tiny:llama", "--quick", "--inject", "corrupt-k"]) == 1
    assert "K/V reconstruction" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.default_model
def test_default_model_matrix(capsys):
    assert main(["verify", "--quick", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    jsonschema.validate(data, SCHEMA)
    rows = {r["name"]: r for r in data["reports"][0]["rows"]}
    assert all(r["verdict"] == "pass" for r in rows.values() if r["group"] == "kvstate")
    assert rows["plain: neither"]["verdict"] in ("crashes", "drifts")
    assert rows["plain: mask only"]["verdict"] == "matches"
