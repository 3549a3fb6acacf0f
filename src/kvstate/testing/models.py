"""Model specs shared by the CLI and ``verify``: ``default``, ``tiny:<model_type>`` or a local folder."""

from __future__ import annotations

from typing import Any


def load_model(spec: str, attn: str | None = None, progress: bool = True) -> tuple[Any, Any]:
    """``(model, tokenizer or None)`` for a spec; the same spec always gives the same weights."""
    if spec == "default":
        from .default_model import load_default_model

        return load_default_model(attn_implementation=attn, progress=progress)
    if spec.startswith("tiny:"):
        from .tiny import tiny_model

        return tiny_model(spec.removeprefix("tiny:"), attn=attn), None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(spec, dtype="float32", local_files_only=True, **kwargs)
    return model.eval(), AutoTokenizer.from_pretrained(spec, local_files_only=True)
