import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
# Self-check verdicts go to a fresh folder per test run, never the user's cache.
os.environ.setdefault("KVSTATE_SELFCHECK_CACHE", tempfile.mkdtemp(prefix="kvstate-selfcheck-"))
