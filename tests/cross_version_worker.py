"""One side of the cross-version file test (tests/test_state_files_versions.py), run by any Python.

    python cross_version_worker.py save FOLDER ARCH,...   # weights + a state of a conversation's prefix
    python cross_version_worker.py load FOLDER ARCH,...   # continue those states here

Both sides load the weights from FOLDER/ARCH with ``from_pretrained``, so they run the same
model whatever each transformers version's random init would give. Each side writes its
continuation (logits ``[N, V]`` and greedy tokens ``[1, N]``) to FOLDER/ARCH/<side>.safetensors.
One process per side and direction: starting Python with torch costs seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvstate import Session
from kvstate.testing.tiny import IMAGE_TEXT, QWEN_VL, image_span, tiny_image, tiny_model, tiny_prompt

NEW = 6


def conversation(arch: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if arch not in QWEN_VL:
        return tiny_prompt(30, seed=3), {}
    pixels, grid, n = tiny_image((4, 6), seed=0)
    ids = torch.cat([tiny_prompt(8, seed=3), image_span(n), tiny_prompt(12, seed=4)], 1)
    return ids, {"pixel_values": pixels, "image_grid_thw": grid}


def load_weights(folder: Path, arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if arch in IMAGE_TEXT else AutoModelForCausalLM
    model = auto.from_pretrained(str(folder / "model"), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly NEW tokens on every side
    return model


def continuation(model: torch.nn.Module, state_file: Path, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    out = Session.load(state_file, model).generate(ids, max_new_tokens=NEW, do_sample=False,
                                                   return_dict_in_generate=True, output_logits=True)
    return {"logits": torch.stack(out.logits, 1)[0].contiguous(), "tokens": out.sequences.contiguous()}


def main() -> None:
    action, root = sys.argv[1], Path(sys.argv[2])
    for arch in sys.argv[3].split(","):
        folder, (ids, inputs) = root / arch, conversation(arch)
        if action == "save":
            tiny_model(arch).save_pretrained(str(folder / "model"))
            model = load_weights(folder, arch)
            session = Session(model)
            session.extend(ids[:, :-2], **inputs)  # the image is in the prefix; two text tokens stay unprocessed
            session.save(folder / "state.kvs")
            save_file(continuation(model, folder / "state.kvs", ids), str(folder / "saved-side.safetensors"))
        else:
            save_file(continuation(load_weights(folder, arch), folder / "state.kvs", ids),
                      str(folder / "read-side.safetensors"))


if __name__ == "__main__":
    main()
