"""The tested transformers window, checked when kvstate is imported (no torch, no transformers import).

kvstate supports every transformers minor from ``OLDEST`` through ``NEWEST``; each is tested
by ``scripts/version_window.py`` (``docs/versions.md``), and CI runs the full suite on the
newest plus a subset on the oldest. Outside the window ``import kvstate`` fails with one
line naming it; ``KVSTATE_ALLOW_ANY_TRANSFORMERS=1`` turns that into a warning, at the
user's risk (cache internals move between minors: a wrong guess would be silent drift,
which is why the default is to refuse).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import warnings

OLDEST, NEWEST = (5, 14), (5, 25)
OVERRIDE = "KVSTATE_ALLOW_ANY_TRANSFORMERS"


def window() -> str:
    """The window in words, e.g. ``transformers >=5.14,<5.26``."""
    return f"transformers >={OLDEST[0]}.{OLDEST[1]},<{NEWEST[0]}.{NEWEST[1] + 1}"


def minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``5.25.0`` or ``5.26.0.dev0``."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return int(match.group(1)), int(match.group(2))


@functools.cache  # a process cannot swap the transformers it imported: its metadata is read once
def installed() -> str:
    """The installed transformers version (from its metadata: nothing is imported)."""
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def in_window(version: str) -> bool:
    try:
        return OLDEST <= minor(version) <= NEWEST
    except ValueError:
        return False


# Families whose transformers code continues a multi-token chunk from a cached state wrongly before a
# minor: 5.14's LFM2 treats any chunk after a cached state as one decode token (its conv output has
# one column, broadcast over the chunk). kvstate feeds them one token per forward there, which is exact.
_CHUNKS_FROM = {"lfm2": (5, 15)}


def continues_in_chunks(family: str) -> bool:
    """Whether the installed transformers continues ``family`` exactly on multi-token chunks."""
    since = _CHUNKS_FROM.get(family)
    return since is None or not in_window(installed()) or minor(installed()) >= since


def check() -> None:
    """Refuse (or, with the override, warn about) a transformers outside the tested window."""
    version = installed()
    if in_window(version):
        return
    message = (f"kvstate supports {window()}, found transformers {version}: install a version in the window "
               f"(pip install '{window()}'), or set {OVERRIDE}=1 to run untested at your own risk")
    if os.environ.get(OVERRIDE, "") not in ("", "0"):
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return
    from ..errors import TransformersVersionError

    raise TransformersVersionError(message)
