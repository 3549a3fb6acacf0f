import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
# Self-check verdicts go to a fresh folder per test run, never the user's cache.
os.environ.setdefault("KVSTATE_SELFCHECK_CACHE", tempfile.mkdtemp(prefix="kvstate-selfcheck-"))
# The suite runs on two pytest-xdist workers (pyproject's addopts): one torch thread each, and the
# processes the tests start inherit it, so two workers never oversubscribe the two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest

# The compatibility subset (`pytest -m window`) that .ci/run also runs on the oldest transformers in the
# window and scripts/version_window.py on every minor: every family adapter, generate's options, the state
# files, compression, media and verify, and files across versions. Tests of the default model
# stay out: its extra needs transformers 5.23+ (the first minor that converts its GGUF tokenizer right).
WINDOW = {"test_families.py", "test_generate_options.py", "test_state_files.py", "test_state_files_versions.py",
          "test_compress.py", "test_compress_watch.py", "test_compress_heads.py", "test_compress_state.py",
          "test_compress_methods.py", "test_media_video.py", "test_media_gemma3.py", "test_verify_matrix.py",
          "test_schedule_turn_marks.py"}


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in WINDOW and item.get_closest_marker("default_model") is None:
            item.add_marker(pytest.mark.window)
    # the long tests first (a stable sort): a worker that drew one of them last ran it alone at the end
    # while the other sat idle, up to half a minute of the suite's wall time
    items.sort(key=lambda item: not (item.get_closest_marker("slow") or item.get_closest_marker("default_model")))
