"""State files across transformers versions: saved under another minor of the window and
continued under this one, and the other way round, with equal tokens and first-step logits within 1e-5 x
max |logit|. ``KVSTATE_OTHER_PYTHON`` names the Python of a virtual environment with another minor;
``.ci/run`` runs this in its compatibility job (the oldest minor) against the newest. Without it these
tests are skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kvstate import inspect_state
from kvstate.testing import assert_logits_close

WORKER = Path(__file__).parent / "cross_version_worker.py"
OTHER = os.environ.get("KVSTATE_OTHER_PYTHON")
pytestmark = pytest.mark.skipif(not OTHER, reason="KVSTATE_OTHER_PYTHON is not set (.ci/run sets it)")
ARCHS = ("llama", "gemma3_text", "lfm2", "qwen3_vl")  # dense, sliding window, recurrent, M-RoPE with an image


def _run(python: str, *args: str) -> None:
    done = subprocess.run([python, str(WORKER), *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


def _version(python: str) -> str:
    return subprocess.run([python, "-c", "import transformers; print(transformers.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize("direction", ["other-to-this", "this-to-other"])
def test_state_files_cross_transformers_versions(direction, tmp_path):
    writer, reader = (OTHER, sys.executable) if direction == "other-to-this" else (sys.executable, OTHER)
    versions = _version(writer), _version(reader)
    assert versions[0] != versions[1], f"KVSTATE_OTHER_PYTHON runs this same transformers {versions[0]}"
    _run(writer, "save", str(tmp_path), ",".join(ARCHS))
    _run(reader, "load", str(tmp_path), ",".join(ARCHS))
    for arch in ARCHS:
        assert inspect_state(tmp_path / arch / "state.kvs")["created_with"]["transformers"] == versions[0]
        saved = load_file(str(tmp_path / arch / "saved-side.safetensors"))
        read = load_file(str(tmp_path / arch / "read-side.safetensors"))
        what = f"{arch}: saved under {versions[0]}, continued under {versions[1]}"
        assert read["tokens"].tolist() == saved["tokens"].tolist(), what
        assert_logits_close(read["logits"][0], saved["logits"][0], what)
