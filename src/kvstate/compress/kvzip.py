"""KVzip: keep the slots the model needs to reconstruct its context (Kim et al. 2025, arXiv:2505.23416).

The context is fed again after an instruction to repeat it, inside the model's chat turn
(``kvstate.compress.template``), ``chunk`` tokens at a time. For each attention layer and
KV head, a slot scores the most attention any re-reading query of the head's group paid
it, in the reference's softmax: over the first ``sinks`` slots, the slots of the chunk
being re-read and the re-read tokens themselves, scaled by ``1/sqrt(d)``, causal among the
re-read tokens (``kvstate.compress.reread``). KVzip+ (``normalize=True``) divides each row
by the norm of the query's hidden state and multiplies each column by the norm of the
value's contribution through the output projection. By default one ranking across every
attention layer and head decides, with no floor (the reference needs none); on a hybrid
model one kind of layer stays whole and the other gives the ratio (``Ranking``). The re-read costs about
one more prefill of the context; its state is discarded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError, UnsupportedError
from .policies import Facts, Needs, Ranked, ScoreInput, with_sinks

KVZIP_PROMPT = "\n\nRepeat the previous context exactly.\n"
SOFTMAX = ("chunk", "model")
PREFIX = ("sink", "evict", "reread")


@dataclass(frozen=True)
class KVzip(Ranked):
    """KVzip (see the module docstring). ``KVzip(0.5)`` is the reference method.

    Args:
        prompt: None (the model's own re-read: its chat template, else raw text, else none), or the token
            ids of an instruction (``kvzip_prompt(tokenizer)``; ``()``: a plain re-read), fed before each
            chunk after the last 8 tokens of the chunk before, with no chat suffix.
        chunk, sinks: re-read chunk length; slots at the first ``sinks`` positions always stay.
        softmax: ``"chunk"``, the reference's score; ``"model"``, the peak of the model's own attention over
            every key its layer sees (eager weights; the earlier kvstate score).
        normalize: KVzip+'s normalisation.
        prefix: the chat template's tokens before the user's content (a system prompt), when the state starts
            with them: ``"sink"``, the reference's (Kim et al.'s code: they are its sinks, always kept and in
            every softmax; only the context after them is re-read); ``"evict"``, kvpress's ``KVzipPress``
            (they are not re-read and score 0, so they go first; only the first ``sinks`` slots stay);
            ``"reread"``, kvstate's earlier (re-read as part of the context).
        heads, scope, floor, sliding, count: ``Ranked``. ``KVzip(r, prompt=..., softmax="model", heads=False,
            scope="layer")`` is kvstate's earlier KVzip.
    """

    prompt: tuple[int, ...] | None = None
    chunk: int = 2048
    sinks: int = 4
    softmax: str = "chunk"
    normalize: bool = False
    prefix: str = "sink"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prompt is not None and (not isinstance(self.prompt, tuple) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.prompt)):
            raise InputError("KVzip prompt must be token ids", expected="None or a tuple of ints "
                             "(tokenizer.encode(...))", found=repr(self.prompt)[:80],
                             fix="KVzip(0.5) finds the model's own re-read; or KVzip(prompt=kvzip_prompt(tokenizer))")
        if self.chunk < 16 or self.sinks < 0 or self.softmax not in SOFTMAX or not isinstance(self.normalize, bool) \
                or self.prefix not in PREFIX:
            raise InputError("invalid KVzip settings", expected=f"chunk >= 16, sinks >= 0, softmax one of {SOFTMAX}, "
                             f"prefix one of {PREFIX}",
                             found={"chunk": self.chunk, "sinks": self.sinks, "softmax": self.softmax,
                                    "prefix": self.prefix,
                                    "normalize": self.normalize})
        if self.normalize and self.softmax != "chunk":
            raise InputError("KVzip+ normalises the reference score", expected="softmax='chunk' with normalize=True",
                             found={"softmax": self.softmax}, fix="drop normalize, or softmax='chunk'")

    def needs(self) -> Needs:
        return Needs(reconstruct=True, prompt=self.prompt, chunk=self.chunk, softmax=self.softmax,
                     sinks=self.sinks, normalize=self.normalize, prefix=self.prefix)

    def check(self, facts: Facts) -> None:
        if self.normalize and not facts.out_projections:
            raise UnsupportedError("KVzip+ (normalize=True) reads each attention layer's output projection",
                                   found=f"{facts.family}: an attention layer without a readable o_proj",
                                   fix="use KVzip without normalize")

    def scores(self, x: ScoreInput) -> torch.Tensor:
        """``[B, H, S]`` (``[B, S]`` with ``heads=False``). A question-aware compression (``query_ids``) scores
        with the peak attention the question paid each slot."""
        if self.softmax == "chunk" and x.reread is not None:
            return with_sinks(self.per_head(x.reread.float()), x, self.sinks)
        if x.peak is None:
            raise InputError("KVzip scores from a reconstruction pass", expected="ScoreInput.reread [B, H, S] "
                             "or ScoreInput.peak [B, Hq, S]", found=None, fix="let Session.compress run it")
        kv = x.keys.shape[1]
        peak = x.peak.float()
        per_head = peak.view(peak.shape[0], kv, -1, peak.shape[-1]).amax(dim=2)  # [B, H, S]
        return with_sinks(self.per_head(per_head), x, self.sinks)


def kvzip_prompt(tokenizer: object, text: str = KVZIP_PROMPT) -> tuple[int, ...]:
    """The token ids of an instruction, for ``KVzip(prompt=...)`` (raw text, outside any chat template)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    return tuple(int(t) for t in ids)
