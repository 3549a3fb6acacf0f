"""State files: ``container`` (the safetensors layout, checksums, atomic writes),
``schema`` (``State`` <-> header + named tensors), ``paths`` (what a save may replace, bounded
input reads) and ``api`` (save, load, inspect).

Arrows point one way: ``api -> schema -> container``, and ``schema -> state``; the
``State`` type knows nothing about files.
"""

from .api import inspect_state, load_state, save_state, state_from_bytes, state_to_bytes

__all__ = ["inspect_state", "load_state", "save_state", "state_from_bytes", "state_to_bytes"]
