"""Model specs, used by the CLI, the server and ``verify``: ``default``, ``smollm2``, ``tiny:<model_type>`` or a
local folder.

kvstate never downloads: a folder must hold ``config.json`` and weights (and a tokenizer
for commands that take text). Hub ids are refused with the command that fetches them.

``dtype`` and ``device`` are resolved per spec (the canonical schedule):

* ``dtype="auto"`` is the checkpoint's own dtype for a folder (``config.dtype``, else the
  weights' dtype, as ``from_pretrained(dtype="auto")`` reads it), and float32 for the
  embedded models (``default``: Gemma-3-270M, ``smollm2``: SmolLM2-135M; their caches hold
  the lossless float32 dequantization of their GGUFs) and tiny models;
* ``device="auto"`` is CUDA where available for a folder, and the CPU for the embedded and
  tiny models, which are demo, benchmark and test models.

An unavailable device is refused before any weights load. Nothing here imports torch at
import time, so the CLI can build its parser from these names and still start fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import DeviceUnavailableError, InputError

ATTENTION_BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "mps")
EMBEDDED = ("default", "smollm2")  # models shipped by pip packages, converted once into the user cache


def load_model(spec: str, attn: str | None = None, progress: bool = True, need_tokenizer: str | None = None, *,
               dtype: Any = "auto", device: Any = "auto") -> tuple[Any, Any]:
    """``(model, tokenizer or None)`` for a spec, in eval mode on ``device``; the same spec gives the same weights.

    ``need_tokenizer`` names the command that needs text: a spec without a tokenizer is
    then refused before any weights load. ``dtype`` is ``"auto"``, a name from ``DTYPES``
    or a ``torch.dtype``; ``device`` is ``"auto"`` or anything ``torch.device`` takes.
    """
    if attn is not None and attn not in ATTENTION_BACKENDS:
        raise InputError("unknown attention backend", expected=ATTENTION_BACKENDS, found=attn,
                         fix="pick one of the listed backends")
    named = resolve_dtype(dtype)  # a typo is refused before the device or any weights
    builtin = spec in EMBEDDED or spec.startswith("tiny:")
    target = resolve_device(device, accelerate=not builtin)
    if spec in EMBEDDED:
        model, tokenizer = _embedded(spec, attn, progress, named)
    elif spec.startswith("tiny:"):
        model, tokenizer = _tiny(spec, attn, need_tokenizer), None
        model = model if named is None else model.to(named)
    else:
        model, tokenizer = _folder(spec, attn, need_tokenizer, named)
    return model.to(target).eval(), tokenizer


def resolve_dtype(dtype: Any) -> Any:
    """``None`` for ``"auto"`` (the spec decides), else the ``torch.dtype``; anything else is refused."""
    if dtype is None or dtype == "auto":
        return None
    import torch

    if isinstance(dtype, torch.dtype) and str(dtype).removeprefix("torch.") in DTYPES:
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return getattr(torch, dtype)
    raise InputError("unknown model dtype", expected=DTYPES, found=dtype, fix="pick one of the listed dtypes")


def resolve_device(device: Any, accelerate: bool = True) -> Any:
    """The ``torch.device`` to load onto; ``"auto"`` is CUDA where available when ``accelerate``, else the CPU.

    A device this machine does not have raises ``DeviceUnavailableError`` naming what it has.
    """
    import torch

    if device is None or device == "auto":
        return torch.device("cuda" if accelerate and torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError("unknown device", expected=DEVICES, found=device, fix="pick one of the listed devices") \
            from exc
    if not _available(target):
        raise DeviceUnavailableError(f"device {str(target)!r} is not available on this machine",
                                     expected=" or ".join(available_devices()), found=str(target),
                                     fix="pass --device cpu (or auto), or install a torch build for that device")
    return target


def available_devices() -> list[str]:
    """The device types this process can load onto."""
    import torch

    mps = getattr(torch.backends, "mps", None)
    return ["cpu", *(["cuda"] if torch.cuda.is_available() else []),
            *(["mps"] if mps is not None and mps.is_available() else [])]


def _available(target: Any) -> bool:
    import torch

    if target.type == "cuda":
        return torch.cuda.is_available() and (target.index or 0) < torch.cuda.device_count()
    return target.type in available_devices() and (target.index or 0) == 0


def _embedded(spec: str, attn: str | None, progress: bool, dtype: Any) -> tuple[Any, Any]:
    import torch

    if spec == "smollm2":
        from .smollm2 import load_smollm2 as load
    else:
        from .default import load_default_model as load
    return load(dtype=dtype or torch.float32, attn_implementation=attn, progress=progress)


def _tiny(spec: str, attn: str | None, need_tokenizer: str | None) -> Any:
    if need_tokenizer:
        raise InputError(f"{need_tokenizer} needs text, and tiny models have no tokenizer", found=spec,
                         fix="use --model default, or a folder with tokenizer files")
    from .tiny import CONFIGS, tiny_model

    model_type = spec.removeprefix("tiny:")
    if model_type in CONFIGS:  # the hand-made tiny configs of the families kvstate registers
        return tiny_model(model_type, attn=attn)
    from .shrink import tiny_causal_lm  # any other causal-LM type transformers ships

    return tiny_causal_lm(model_type, attn=attn)


def _folder(spec: str, attn: str | None, need_tokenizer: str | None, dtype: Any) -> tuple[Any, Any]:
    folder = Path(spec).expanduser()
    if not (folder / "config.json").is_file():
        hub = not folder.exists() and spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
        raise InputError("no model folder at this path", expected="'default', 'tiny:<model_type>', or a local "
                         "folder with config.json and weights", found=spec,
                         fix=f"kvstate does not download models: run `huggingface-cli download {spec} --local-dir "
                         f"<folder>` where a network is available, then pass --model <folder>" if hub else
                         "check the path; the folder needs config.json and the weights")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..io.paths import check_model_folder

    check_model_folder(folder)  # before transformers reads anything whole

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError):  # a folder without tokenizer files
        tokenizer = None
    if tokenizer is None and need_tokenizer:
        raise InputError(f"{need_tokenizer} needs text, and this model folder has no tokenizer", found=spec,
                         fix="save the tokenizer into the folder (tokenizer.save_pretrained(folder))")
    kwargs = {"attn_implementation": attn} if attn else {}
    # "auto": config.dtype, else the weights' own dtype (never a silent upcast to float32)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype or "auto", local_files_only=True,
                                                 **kwargs)
    return model, tokenizer
