"""`kvstate serve` with its model's forwards logged, for benchmarks that report forwards per request.

    KVSTATE_BENCH_FORWARDS=/tmp/forwards.log python bench/serve_counted.py serve --model default ...

Each forward of the served model appends one line to that file: the number of tokens it fed. It counts the calls
of the model's input embedding (one per forward) through torch's global forward pre-hook, so the model's own
hook tables (part of kvstate's self-check) stay as they are. It runs whichever kvstate the interpreter imports:
``PYTHONPATH=<an older checkout>/src`` measures that code (``bench_serve_reuse.py --before``).
"""

from __future__ import annotations

import os
import sys
from typing import Any


def main() -> int:
    import torch

    from kvstate import cli
    from kvstate.serve import cli as serve_cli

    log = open(os.environ["KVSTATE_BENCH_FORWARDS"], "a", buffering=1)  # noqa: SIM115 (open for the process)
    load = serve_cli.load

    def counted(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        model, tokenizer = load(*args, **kwargs)
        embedding = model.get_input_embeddings()

        def seen(module: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
            if module is embedding:
                log.write(f"{inputs[0].shape[-1] if inputs else 0}\n")

        torch.nn.modules.module.register_module_forward_pre_hook(seen)
        return model, tokenizer

    serve_cli.load = counted  # kvstate serve loads its model through this name
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
