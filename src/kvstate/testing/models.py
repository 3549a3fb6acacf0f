"""Model specs shared by the CLI and ``verify``: ``default``, ``tiny:<model_type>`` or a local folder.

kvstate never downloads: a folder must hold ``config.json`` and weights (and a tokenizer
for commands that take text). Hub ids are refused with the command that fetches them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InputError

ATTENTION_BACKENDS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


def load_model(spec: str, attn: str | None = None, progress: bool = True,
               need_tokenizer: str | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer or None)`` for a spec; the same spec always gives the same weights.

    ``need_tokenizer`` names the command that needs text: a spec without a tokenizer is
    then refused before any weights load.
    """
    if attn is not None and attn not in ATTENTION_BACKENDS:
        raise InputError("unknown attention backend", expected=ATTENTION_BACKENDS, found=attn,
                         fix="pick one of the listed backends")
    if spec == "default":
        from .default_model import load_default_model

        return load_default_model(attn_implementation=attn, progress=progress)
    if spec.startswith("tiny:"):
        from .tiny import CONFIGS, tiny_model

        if need_tokenizer:
            raise InputError(f"{need_tokenizer} needs text, and tiny models have no tokenizer", found=spec,
                             fix="use --model default, or a folder with tokenizer files")
        model_type = spec.removeprefix("tiny:")
        if model_type in CONFIGS:  # the hand-made tiny configs of the families kvstate registers
            return tiny_model(model_type, attn=attn), None
        from .shrink import tiny_causal_lm  # any other causal-LM type transformers ships

        return tiny_causal_lm(model_type, attn=attn), None
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
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype="float32", local_files_only=True, **kwargs)
    return model.eval(), tokenizer
