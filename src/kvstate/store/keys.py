"""Prefix keys: a SHA-256 chain over fixed-size token chunks, as LMCache and vLLM key their blocks.

``salt = SHA-256(JSON{format 1, model fingerprint, dtype, namespace, compressed})``,
then for chunk ``i`` (tokens ``[i*C, (i+1)*C)``):
``h_i = SHA-256(h_{i-1} || tokens as int64 little-endian || "|".join(media hashes))``,
where the media hashes are those of the images whose placeholder run starts in the
chunk. The key of the prefix of ``i + 1`` chunks is ``h_i`` in hex. Two different
models, namespaces, dtypes, images or compression settings never share a key.
Python's ``hash()`` is never used: keys must agree across processes and machines.
"""

from __future__ import annotations

import hashlib
import json

import torch

from ..identity import Fingerprint

KEY_FORMAT = 1


def salt(fingerprint: Fingerprint, namespace: str, compressed: bool) -> bytes:
    identity = {k: v for k, v in fingerprint.to_dict().items() if k not in ("config_json", "transformers")}
    blob = json.dumps({"format": KEY_FORMAT, "fingerprint": identity, "dtype": fingerprint.dtype,
                       "namespace": namespace, "compressed": compressed}, sort_keys=True)
    return hashlib.sha256(blob.encode()).digest()


def chain(seed: bytes, tokens: torch.Tensor, chunk: int, media: list[tuple[int, str]]) -> list[str]:
    """Keys of the prefixes of 1, 2, ... full chunks of ``tokens`` ``[T]``."""
    keys = []
    h = seed
    data = tokens.to("cpu", torch.int64).contiguous()
    for i in range(data.shape[0] // chunk):
        block = data[i * chunk:(i + 1) * chunk].numpy().astype("<i8").tobytes()
        hashes = [digest for start, digest in media if i * chunk <= start < (i + 1) * chunk]
        h = hashlib.sha256(h + block + "|".join(hashes).encode()).digest()
        keys.append(h.hex())
    return keys
