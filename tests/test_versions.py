"""The transformers window: refused outside it with one line, overridable, reported by verify."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvstate._compat import versions

# Imports kvstate as if transformers VERSION were installed: the gate reads the version from package
# metadata (it imports nothing), so replacing that lookup is what a different install would show it.
PRETEND = """
import importlib.metadata as metadata, sys
real = metadata.version
metadata.version = lambda name: sys.argv[1] if name == "transformers" else real(name)
import kvstate
print("imported")
"""


def _import_as(version: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PRETEND, version], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


@pytest.mark.parametrize("version", ["5.13.1", "4.57.6", "5.26.0", "6.0.0.dev0"])
def test_a_version_outside_the_window_fails_import_with_one_line(version):
    run = _import_as(version, KVSTATE_ALLOW_ANY_TRANSFORMERS="")
    assert run.returncode == 1 and "imported" not in run.stdout
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("kvstate.errors.TransformersVersionError: kvstate supports transformers >=5.14,<5.26")
    assert f"found transformers {version}" in last and "KVSTATE_ALLOW_ANY_TRANSFORMERS=1" in last


def test_the_override_warns_and_imports():
    run = _import_as("5.13.1", KVSTATE_ALLOW_ANY_TRANSFORMERS="1", PYTHONWARNINGS="always")
    assert run.returncode == 0 and "imported" in run.stdout and "RuntimeWarning" in run.stderr


@pytest.mark.parametrize("version, inside", [("5.14.0", True), ("5.14.1", True), ("5.24.0", True),
                                             ("5.24.3.dev0", True), ("5.25.0", True), ("5.13.9", False),
                                             ("5.26.0", False), ("garbage", False)])
def test_window_bounds(version, inside):
    assert versions.in_window(version) is inside


def test_import_kvstate_loads_neither_torch_nor_transformers():
    code = "import sys, kvstate; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_verify_reports_the_version_and_the_window():
    from kvstate.testing.tiny import tiny_model, tiny_prompt
    from kvstate.verify import verify

    report = verify(tiny_model("llama"), tiny_prompt(12), new_tokens=2, quick=True)
    env = report.to_dict()["environment"]
    assert env["transformers"] == versions.installed() and env["in_window"] is True
    assert f"inside the tested window {versions.window()}" in report.table()


def test_a_wrong_default_model_tokenizer_is_refused_with_the_fix():
    from kvstate.errors import DefaultModelError
    from kvstate.testing.default_model import GOOD_GGUF_TOKENIZER, check_tokenizer
    from kvstate.testing.tiny_tokenizer import tiny_tokenizer

    with pytest.raises(DefaultModelError) as info:  # any tokenizer but Gemma 3's encodes the sentence otherwise
        check_tokenizer(tiny_tokenizer(), "converted from the GGUF")
    assert f"transformers>={GOOD_GGUF_TOKENIZER}" in str(info.value) and "[2, 818, 5279, 529, 7001, 563]" in str(
        info.value)
