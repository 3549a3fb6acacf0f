"""What a request's generation options become in the ``Scheduler``, or why it runs alone.

The runner (``kvstate.serve.runner``) hands every request to one ``kvstate.batch.Scheduler``. Its options
(what ``params`` maps: greedy and sampling with ``stop`` strings, ``logprobs``, ``logit_bias``,
``repetition_penalty`` and the presence / frequency penalties) are resolved against the model's generation
config as ``generate`` resolves them (``kvstate.options.resolve``), and become the request's ``Sampling``
(temperature, top-k, top-p, min-p, seed: ``generate``'s draw, ``kvstate.batch.sampling``) and its logits
processors, in ``generate``'s order. A request whose resolved options hold anything else (an option no
route maps today, or a generation-config default the sampler has no equivalent for, such as ``typical_p``
or ``no_repeat_ngram_size``) runs through ``Session.generate`` instead, alone (``kvstate.serve.alone``).

Options transformers checks only when ``generate`` builds its processors and criteria (a ``logit_bias`` on a
token outside the vocabulary, a stop string no token spells) are checked here the same way, before anything
runs, so such a request is a 400 that commits nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from ..batch import BatchRequest, Sampling
from ..options import resolve

# what params produces and the scheduler serves; the last two: logprobs, which the sampler gives
SCHEDULED = {"max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "stop_strings",
             "sequence_bias", "repetition_penalty", "logits_processor", "output_logits", "return_dict_in_generate"}
# generation-config fields that change the choice of a token and the sampler has no equivalent for, with their
# values that do nothing (a model's own generation config may set them: then the request runs alone)
UNSERVED = {"typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "top_h": (None,),
            "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "min_length": (None, 0),
            "min_new_tokens": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
            "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "renormalize_logits": (None, False),
            "exponential_decay_length_penalty": (None,), "remove_invalid_values": (None, False),
            "watermarking_config": (None,), "max_time": (None,), "encoder_repetition_penalty": (None, 1.0)}


def batch_request(model: Any, ids: list[int], options: dict[str, Any], seed: int | None,
                  logprobs: int | None) -> BatchRequest | None:
    """The ``BatchRequest`` of a history ``ids`` with ``generate`` ``options`` (its ``sources``, ``marks`` and
    media ``inputs`` for the caller to add), or None where the sampler cannot serve them (module docstring)."""
    if set(options) - SCHEDULED:
        return None
    config = resolve(model, {k: v for k, v in options.items() if k != "stop_strings"}).config
    if any(getattr(config, name, None) not in off for name, off in UNSERVED.items()):
        return None
    sampling = Sampling(config.temperature, config.top_k or 0, 1.0 if config.top_p is None else config.top_p,
                        seed=seed, min_p=config.min_p or 0.0) if config.do_sample else Sampling()
    built = _processors(config)
    _check(model, ids, built)
    return BatchRequest(torch.tensor(ids), max_new_tokens=options["max_new_tokens"], sampling=sampling,
                        top_logprobs=logprobs or 0, processors=(*built, *options.get("logits_processor", ())))


def _processors(config: Any) -> tuple[Any, ...]:
    """The logits processors ``generate`` builds for ``config`` that are not sampling's own, in its order:
    ``sequence_bias`` (``logit_bias``), then ``repetition_penalty`` (the request's own, OpenAI's penalties,
    come after them)."""
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    out: list[Any] = []
    if config.sequence_bias:
        out.append(SequenceBiasLogitsProcessor(sequence_bias=config.sequence_bias))
    if config.repetition_penalty not in (None, 1.0):
        out.append(RepetitionPenaltyLogitsProcessor(penalty=config.repetition_penalty))
    return tuple(out)


def _check(model: Any, ids: list[int], processors: tuple[Any, ...]) -> None:
    """Run transformers' processors once on the history and a row of zeros, as ``generate``'s first step would:
    what they refuse (a bias on a token outside the vocabulary) is refused now. A first call changes nothing of
    theirs but tables of the vocabulary's size."""
    from ..adopt import logits_width

    if processors:
        device = next(model.parameters()).device
        history = torch.tensor([ids], dtype=torch.long, device=device)
        scores = torch.zeros(1, logits_width(model), device=device)
        for processor in processors:
            scores = processor(history, scores)
