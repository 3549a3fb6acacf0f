"""One-time conversion of a packaged GGUF into a float32 safetensors folder, shared by the embedded models.

Design:
- The GGUF is only a *source*. The first load dequantizes it once into a float32
  safetensors folder (model.safetensors, config.json, tokenizer files) in the user
  cache; every load, the first included, then reads that folder with plain
  ``from_pretrained``, so all callers get the same weights through the same code path.
- Dequantized GGUF values (Q4_K, Q4_1, ...) are exact in float32, so the copy is
  lossless; the requested dtype is applied when loading.
- The conversion uses the public ``from_pretrained(gguf_file=...)`` (it needs
  ``accelerate``); ``save_pretrained`` refuses GGUF-loaded models as quantized, so the
  tensors are written with ``safetensors`` directly, tied weights once.
- The caller's tokenizer check runs on the converted tokenizer before anything is
  written (a wrong conversion is never cached) and again on every load.
- Files are written into a temp path beside the target and renamed into place,
  so an interrupted run never leaves a cache entry that looks complete.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

WEIGHTS = "model.safetensors"
TokenizerCheck = Callable[[Any, str], None]  # (tokenizer, how it was obtained) -> None, or raises


def cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    """``cache_dir``, else the user cache dir (``platformdirs.user_cache_dir("kvstate")``)."""
    if cache_dir is not None:
        return Path(cache_dir)
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvstate"))


def say(progress: bool, message: str) -> None:
    if progress:
        from tqdm.auto import tqdm

        tqdm.write(f"[kvstate] {message}", file=sys.stderr)


def quiet(progress: bool) -> contextlib.AbstractContextManager[Any]:
    """Silence the bars transformers draws on stderr when progress is off."""
    return contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())


def _dequantize(gguf: Path, progress: bool) -> tuple[dict[str, torch.Tensor], Any]:
    """Load the GGUF with transformers (float32) and return its unique tensors and config."""
    from transformers import AutoModelForCausalLM

    with quiet(progress):
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    # Tied weights (lm_head = embed_tokens) appear twice in state_dict; store them once.
    unique = dict(model.named_parameters())
    unique.update(dict(model.named_buffers()))
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items() if name in unique}
    config = model.config
    config.architectures = [type(model).__name__]  # the GGUF does not record it
    return tensors, config


def convert(gguf: Path, target: Path, progress: bool, check: TokenizerCheck) -> None:
    """Write the safetensors copy of the GGUF to ``target``, atomically, after ``check`` accepts its tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    start = time.perf_counter()
    say(progress, f"one-time conversion of {gguf.name} to safetensors (about a minute)")
    say(progress, "dequantizing GGUF tensors to float32")
    tensors, config = _dequantize(gguf, progress)
    say(progress, "reading the tokenizer from the GGUF")
    with quiet(progress):
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    check(tokenizer, "converted from the GGUF")  # never cache a wrong conversion
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        say(progress, f"writing safetensors to {target}")
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
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
    say(progress, f"converted in {time.perf_counter() - start:.1f}s; later loads take seconds")


def _publish(tmp: Path, target: Path) -> None:
    try:
        os.replace(tmp, target)
    except OSError:
        if not is_complete(target):  # a concurrent run that won the race is fine
            raise


def is_complete(folder: Path) -> bool:
    return (folder / WEIGHTS).is_file() and (folder / "config.json").is_file()


_TOKENIZERS: dict[str, Any] = {}


def checked_tokenizer(folder: str, check: TokenizerCheck) -> Any:
    """The tokenizer of ``folder``, checked, loaded on first use in this process (kvstate never changes it)."""
    if folder not in _TOKENIZERS:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        check(tokenizer, f"loaded from {folder}")
        _TOKENIZERS[folder] = tokenizer
    return _TOKENIZERS[folder]


def load_folder(folder: Path, check: TokenizerCheck, dtype: torch.dtype, progress: bool,
                attn_implementation: str | None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a converted folder, the model in eval mode (a new instance every call)."""
    from transformers import AutoModelForCausalLM

    with quiet(progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, attn_implementation=attn_implementation or "sdpa"
        )
        tokenizer = checked_tokenizer(str(folder), check)
    return model.eval(), tokenizer
