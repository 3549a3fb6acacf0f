"""OpenAI-compatible test servers with a real prefix cache over a tiny real model, each planting one fault.

Independent of kvstate's own serving code, so ``verify --against`` is tested against servers it did
not produce. The engine is a block cache like vLLM's: a prompt is prefilled in 32-token chunks
aligned to multiples of 32, a hit reuses a multiple of 32 slots of the entry sharing the longest
prefix, and what is left is fed in the same aligned chunks, so a correct hit is bitwise the cold
run. Images become 64 tokens derived from their bytes (a discrete image tokenizer), which the
entries' keys hold. ``FAULTS`` each break one rule:

- ``refeed-last``: a full hit reuses every prompt slot and feeds the last token again;
- ``drop-last``: a full hit never feeds the last prompt token;
- ``stale-key``: entries are keyed by their first 48 tokens, and a hit trusts the key;
- ``media-key``: keys hold a placeholder instead of the image's tokens;
- ``leak``: while another request is in flight, a lookup takes the newest entry, whoever made it;
- ``shift-positions``: tokens fed after a hit get positions one too far.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from tests.serving import uvicorn_app

FAULTS = ("refeed-last", "drop-last", "stale-key", "media-key", "leak", "shift-positions")
BLOCK, KEY_TOKENS, IMAGE_TOKENS, PLACEHOLDER = 32, 48, 64, 3


def tiny_llama() -> tuple[Any, Any]:
    """A 2-layer llama with large random weights (so its greedy answers depend on the whole context) and the
    tiny character tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvstate.models.tiny_tokenizer import tiny_tokenizer

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                                  initializer_range=1.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), tiny_tokenizer()


@dataclass
class Entry:
    tokens: tuple[int, ...]
    key: tuple[int, ...]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, keys and values [1, H, S, D] of every prompt token


class Engine:
    """Greedy generation with a prefix cache (``cache=False``: none, every request cold)."""

    def __init__(self, model: Any, tokenizer: Any, fault: str | None = None, cache: bool = True) -> None:
        self.model, self.tokenizer, self.fault, self.caching = model, tokenizer, fault, cache
        self.entries: list[Entry] = []
        self.lock = threading.Lock()
        self.active = 0

    def reset(self) -> None:
        with self.lock:
            self.entries.clear()

    def _lookup(self, ids: list[int], key: list[int], crowded: bool) -> tuple[Entry | None, int]:
        """The entry to reuse and how many of its tokens it claims to share with the prompt."""
        if not self.entries:
            return None, 0
        if self.fault == "leak" and crowded:
            newest = self.entries[-1]
            return newest, min(len(newest.tokens), len(ids))
        if self.fault == "stale-key":
            same = [e for e in self.entries if e.key[:KEY_TOKENS] == tuple(key[:KEY_TOKENS])]
            return (same[-1], min(len(same[-1].tokens), len(ids))) if same else (None, 0)
        best, length = None, 0
        for entry in self.entries:
            n = _common(entry.key, key)
            if n > length:
                best, length = entry, n
        return best, length

    def _plan(self, ids: list[int], entry: Entry | None, match: int) -> tuple[int, list[int], int, int]:
        """``(reused slots, tokens to feed, position of the first, extra position offset)``."""
        n = len(ids)
        if entry is None or match < BLOCK:
            return 0, ids, 0, 0
        if match >= n and self.fault == "refeed-last":
            return n, ids[-1:], n, 0
        if match >= n and self.fault == "drop-last":
            return n - 2, ids[n - 2:n - 1], n - 2, 0
        reuse = min(match, n - 1) // BLOCK * BLOCK
        return reuse, ids[reuse:], reuse, 1 if self.fault == "shift-positions" and reuse else 0

    @torch.no_grad()
    def generate(self, ids: list[int], key: list[int], max_tokens: int) -> tuple[list[int], list[float], int]:
        """Greedy tokens, their logprobs, and the prompt tokens served from the cache."""
        self.active += 1
        try:
            if self.fault == "leak":  # let concurrent requests arrive, as a batching engine waits for its step
                time.sleep(0.05)
            with self.lock:
                return self._generate(ids, key, max_tokens)
        finally:
            self.active -= 1

    def _generate(self, ids: list[int], key: list[int], max_tokens: int) -> tuple[list[int], list[float], int]:
        from transformers import DynamicCache

        entry, match = self._lookup(ids, key, self.active > 1) if self.caching else (None, 0)
        reuse, feed, start, shift = self._plan(ids, entry, match)
        cache = DynamicCache()
        for layer, (k, v) in enumerate(entry.kv if reuse else []):
            cache.update(k[:, :, :reuse].clone(), v[:, :, :reuse].clone(), layer)
        logits = self._prefill(feed, cache, start, shift)
        if self.caching and start + len(feed) == len(ids):
            self.entries = [*self.entries[-31:], Entry(tuple(ids), tuple(key), _snapshot(cache))]
        return (*self._decode(logits, cache, start + len(feed) + shift, max_tokens), reuse)

    def _prefill(self, feed: list[int], cache: Any, start: int, shift: int) -> torch.Tensor:
        """Feed ``feed`` from position ``start`` in chunks that end at multiples of BLOCK: a hit at a multiple of
        BLOCK then runs the very chunks of the cold run."""
        s, logits = 0, None
        while s < len(feed):
            size = BLOCK - (start + s) % BLOCK
            logits = self._forward(feed[s:s + size], cache, start + s + shift)
            s += size
        return logits

    def _forward(self, tokens: list[int], cache: Any, position: int) -> torch.Tensor:
        ids = torch.tensor([tokens])
        positions = torch.arange(position, position + len(tokens))[None]
        out = self.model(input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True)
        return out.logits[0, -1]

    def _decode(self, logits: torch.Tensor, cache: Any, position: int,
                max_tokens: int) -> tuple[list[int], list[float]]:
        tokens, logprobs = [], []
        for i in range(max_tokens):
            scores = torch.log_softmax(logits.float(), -1)
            token = int(scores.argmax())
            tokens.append(token)
            logprobs.append(float(scores[token]))
            if i + 1 < max_tokens:
                logits = self._forward([token], cache, position + i)
        return tokens, logprobs


def _snapshot(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def _common(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    """Length of the longest common prefix."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


# ----- HTTP: the OpenAI routes over one Engine ----------------------------------------------------------------
ROLE_TEXT = {"system": ("", "\n\n"), "user": ("User: ", "\n"), "assistant": ("Assistant:", "\n")}


def render(tokenizer: Any, messages: list[dict[str, Any]], media_in_key: bool = True) -> tuple[list[int], list[int]]:
    """Token ids and cache-key ids of a chat (a plain transcript template); an image is 64 tokens from its bytes."""
    ids, key = [tokenizer.bos_token_id], [tokenizer.bos_token_id]

    def text(value: str) -> None:
        tokens = tokenizer(value, add_special_tokens=False).input_ids
        ids.extend(tokens)
        key.extend(tokens)

    for message in messages:
        before, after = ROLE_TEXT.get(message["role"], ("", "\n"))
        text(before)
        content = message["content"]
        for part in [{"type": "text", "text": content}] if isinstance(content, str) else content:
            if part.get("type") == "image_url":
                data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
                tokens = [4 + b % 90 for b in hashlib.shake_256(data).digest(IMAGE_TOKENS)]
                ids.extend(tokens)
                key.extend(tokens if media_in_key else [PLACEHOLDER] * IMAGE_TOKENS)
            else:
                text(part.get("text", ""))
        text(after)
    text("Assistant:")
    return ids, key


def create_app(engine: Engine, name: str = "tiny-fault", images: bool = True, system_role: bool = True,
               strict: bool = False) -> Any:
    """The OpenAI routes over ``engine``; ``strict``: no ``/v1/models``, and ``stream_options`` is refused."""
    app = FastAPI()
    tokenizer = engine.tokenizer

    if not strict:
        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": name, "object": "model"}]}

    @app.post("/reset_prefix_cache")
    def reset() -> dict[str, Any]:
        engine.reset()
        return {"ok": True}

    def complete(body: dict[str, Any], chat: bool) -> Any:
        if strict and "stream_options" in body:
            return JSONResponse({"error": {"message": "unknown field stream_options"}}, status_code=422)
        if chat and not system_role and any(m["role"] == "system" for m in body["messages"]):
            return JSONResponse({"error": {"message": "System role not supported"}}, status_code=400)
        if chat:
            has_image = any(isinstance(m["content"], list) and any(p.get("type") == "image_url" for p in m["content"])
                            for m in body["messages"])
            if has_image and not images:
                return JSONResponse({"error": {"message": "this model takes no images"}}, status_code=400)
            ids, key = render(tokenizer, body["messages"], engine.fault != "media-key")
        else:
            ids = [tokenizer.bos_token_id, *tokenizer(body["prompt"], add_special_tokens=False).input_ids]
            key = ids
        tokens, logprobs, cached = engine.generate(ids, key, int(body.get("max_tokens") or 16))
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(tokens), "total_tokens": len(ids) + len(tokens),
                 "prompt_tokens_details": {"cached_tokens": cached}}
        pieces = [tokenizer.decode([t]) for t in tokens]
        want = bool(body.get("logprobs"))
        if body.get("stream"):
            return StreamingResponse(_stream(pieces, logprobs if want else None, usage, chat,
                                             (body.get("stream_options") or {}).get("include_usage")),
                                     media_type="text/event-stream")
        return _whole(pieces, logprobs if want else None, usage, chat)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        return await run_in_threadpool(complete, body, True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        return await run_in_threadpool(complete, body, False)

    return app


def _logprobs(pieces: list[str], logprobs: list[float] | None, chat: bool) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    if chat:
        return {"content": [{"token": p, "logprob": lp, "top_logprobs": [{"token": p, "logprob": lp}]}
                            for p, lp in zip(pieces, logprobs, strict=True)]}
    top = [{p: lp} for p, lp in zip(pieces, logprobs, strict=True)]
    return {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": top}


def _whole(pieces: list[str], logprobs: list[float] | None, usage: dict[str, Any], chat: bool) -> dict[str, Any]:
    text = "".join(pieces)
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": _logprobs(pieces, logprobs, chat)}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return {"id": "x", "object": "chat.completion" if chat else "text_completion", "choices": [choice], "usage": usage}


def _stream(pieces: list[str], logprobs: list[float] | None, usage: dict[str, Any], chat: bool,
            include_usage: bool | None) -> Iterator[str]:
    for i, piece in enumerate(pieces):
        lp = None if logprobs is None else logprobs[i:i + 1]
        choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": _logprobs([piece], lp, chat)}
        choice.update({"delta": {"content": piece}} if chat else {"text": piece})
        yield f"data: {json.dumps({'choices': [choice]})}\n\n"
    if include_usage:
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


@contextlib.contextmanager
def serve(engine: Engine, **app: Any) -> Iterator[str]:
    """The engine's app on a free loopback port (uvicorn in a thread); yields the base URL."""
    with uvicorn_app(create_app(engine, **app)) as url:
        yield url
