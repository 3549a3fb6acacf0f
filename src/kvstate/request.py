"""``Request``: one ``generate`` call, validated once, before anything runs (issue 22).

``validate`` turns what a caller handed ``Session.generate`` into a frozen value:
the history ``ids`` ``[B, L]`` (a private int64 copy), its bool ``mask`` ``[B, L]``,
the family's media inputs for the whole history, the media ``spans`` and content
hashes, the resolved generation options, the compression budget if any, and the
``PrefixQuery`` sources key the history by. Every broken rule raises a typed error
here; planning and the engine never re-check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch

from .adapters.binding import Binding
from .compress.during import Budget, plan_rounds, split_options
from .errors import InputError, UnsupportedError
from .identity import Fingerprint
from .inputs import as_ids, history_mask, refuse_media
from .options import GenerateOptions, check_length, resolve
from .protocols import PrefixQuery
from .state import MediaItem

IdsLike = torch.Tensor | Sequence[int] | Sequence[Sequence[int]]


@dataclass(frozen=True, eq=False)
class Request:
    """A validated ``generate`` call (see the module docstring).

    ``media`` is None for batches, or when the pixels given do not cover every item
    (then a resume trusts the placeholders); ``query`` is None when no prefix source
    can serve the history (a batch, padding, unknown media).
    """

    ids: torch.Tensor
    mask: torch.Tensor
    inputs: Mapping[str, torch.Tensor]
    spans: tuple[tuple[int, int], ...]
    media: tuple[MediaItem, ...] | None
    options: GenerateOptions
    budget: Budget | None
    query: PrefixQuery | None

    @property
    def batch_size(self) -> int:
        return int(self.ids.shape[0])


def validate(binding: Binding, fingerprint: Fingerprint, input_ids: IdsLike, attention_mask: torch.Tensor | None,
             kwargs: dict[str, object], *, device: torch.device, vocab_size: int) -> Request:
    """The ``Request`` of ``Session.generate(input_ids, attention_mask, **kwargs)``; ``kwargs`` is consumed."""
    budget = split_options(kwargs)
    keys = binding.inputs.keys
    inputs = {k: kwargs.pop(k) for k in keys if k in kwargs}
    refuse_media(kwargs, keys, binding.caps.name)
    options = resolve(binding.model, kwargs)
    ids = as_ids(input_ids, device, vocab_size)
    check_length(options, ids.shape[1])
    mask = history_mask(ids, attention_mask, options.pad_id)
    check_padding(binding, mask)
    spans = tuple(binding.inputs.spans(ids, inputs))
    media = media_items(binding, ids, inputs, spans)
    if budget is not None:
        budget = _check_budget(budget, options, ids, mask)
    query = None
    if ids.shape[0] == 1 and bool(mask.all()) and media is not None:
        query = PrefixQuery(fingerprint, ids.cpu(), tuple((m.start, m.digest) for m in media))
    return Request(ids, mask, MappingProxyType(inputs), spans, media, options, budget, query)  # type: ignore[arg-type]


def check_padding(binding: Binding, mask: torch.Tensor) -> None:
    """Families whose state cannot hold padded rows refuse a padded mask."""
    if not binding.caps.padding and not bool(mask.all()):
        raise UnsupportedError(f"padded batches are not supported for {binding.caps.name} models",
                               found="padding: attention_mask zeros, or pad_token_id in a history given without "
                               "a mask (generate masks those)",
                               fix="run one row per Session; to keep pad ids as tokens, pass "
                               "attention_mask=torch.ones_like(input_ids)")


def media_items(binding: Binding, ids: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                spans: Sequence[tuple[int, int]], offset: int = 0) -> tuple[MediaItem, ...] | None:
    """The media items of ``ids`` ``[1, Q]`` (their ``spans``; slots shifted by ``offset``) with their
    content hashes; None for batches, or when the pixels given do not cover every item."""
    if ids.shape[0] != 1:
        return None
    hashes = binding.inputs.hashes(ids, inputs)
    if hashes is None:
        return None
    ends = dict(spans)
    return tuple(MediaItem(offset + start, offset + ends[start], digest) for start, digest in hashes)


def _check_budget(budget: Budget, options: GenerateOptions, ids: torch.Tensor, mask: torch.Tensor) -> Budget:
    budget = plan_rounds(budget, options, ids.shape[1])
    if ids.shape[0] != 1 or not bool(mask.all()):
        raise UnsupportedError("generate(compress=...) decodes one row without padding",
                               found=f"batch of {ids.shape[0]}, padding: {not bool(mask.all())}",
                               fix="run one row per Session, unpadded")
    return budget


def check_model_object(model: torch.nn.Module) -> None:
    """A transformers model, not in training mode with dropout (every forward would be random)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise InputError("Session takes a loaded transformers model", expected="a PreTrainedModel (torch.nn.Module "
                         "with a config)", found=type(model).__name__,
                         fix="pass AutoModelForCausalLM.from_pretrained(...) or kvstate.testing.tiny_model(...)")
    if model.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        raise InputError("the model is in training mode, with dropout active", expected="model.eval()",
                         found="model.training = True and dropout p > 0", fix="call model.eval() first")


def check_settings(**settings: int | None) -> None:
    rules = {"chunk_size": 1, "canonical_chunk": 0, "sliding_reserve": 0, "max_checkpoints": 0,
             "checkpoint_every": 1}
    for name, value in settings.items():
        if value is None and name == "checkpoint_every":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < rules[name]:
            raise InputError(f"invalid Session setting {name}", expected=f"int >= {rules[name]}",
                             found=repr(value), fix=f"pass {name}={max(rules[name], 1)} or more")
