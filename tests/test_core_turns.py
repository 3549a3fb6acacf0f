"""A conversation over several turns answers what a fresh run would.

* ``continue_text`` keeps every token of an answer in the history, so turn two equals
  plain ``model.generate`` on ``prompt + answer1 + text2``.
* A history given without a mask gets ``model.generate``'s own default mask: pad ids are
  masked unless the pad id is also an EOS id, even inside an earlier answer.

The oracle is always plain transformers on a fresh history; kvstate's state is reused.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate import Session, continue_text
from kvstate.testing.tiny_tokenizer import tiny_tokenizer
from tiny import assert_logits_close, prompt, tiny_model

FAMILIES = ("llama", "gemma3_text")
NO_TEXT = [0, 1, 3, *range(100, 128)]  # specials and the ids the character tokenizer has no text for
TOKENIZER = tiny_tokenizer()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return tiny_model(request.param)


def plain(model, ids, mask=None, **options):
    """New ids and logits of plain ``model.generate`` on ``ids``."""
    out = model.generate(ids, attention_mask=mask, return_dict_in_generate=True, output_logits=True,
                         do_sample=False, **options)
    return out.sequences[:, ids.shape[1]:], out.logits


def kv(session, ids, mask=None, **options):
    out = session.generate(ids, mask, return_dict_in_generate=True, output_logits=True, do_sample=False, **options)
    return out.sequences, out.logits


def assert_same_answer(ours, reference):
    assert torch.equal(ours[0], reference[0]), (ours[0].tolist(), reference[0].tolist())
    for step, (a, b) in enumerate(zip(ours[1], reference[1], strict=True)):
        assert_logits_close(a, b, f"step {step}")


# ----- continue_text ------------------------------------------------------------------------
STOPS = {
    "max_new_tokens": dict(max_new_tokens=5, suppress_tokens=[2, *NO_TEXT]),
    "eos": dict(max_new_tokens=5, eos_token_id=2, forced_eos_token_id=2, suppress_tokens=NO_TEXT),
}


@pytest.mark.parametrize("chunk", [0, 64], ids=["longest-prefix", "canonical"])
@pytest.mark.parametrize("stop", sorted(STOPS))
def test_continue_text_turns_equal_a_fresh_run_on_the_whole_text(model, stop, chunk):
    options = {**STOPS[stop], "do_sample": False}
    session = Session(model, tokenizer=TOKENIZER, canonical_chunk=chunk)
    texts, said = ["Once upon a time", ", said the fox", ". Then"], ""
    for turn, text in enumerate(texts):
        answer = continue_text(session, TOKENIZER, text, **options)
        ids = TOKENIZER(said + text, return_tensors="pt").input_ids
        fresh = model.generate(ids, **options)[0, ids.shape[1]:]
        assert answer == TOKENIZER.decode(fresh, skip_special_tokens=True), (turn, answer)
        said += text + answer
        if turn and not chunk:  # longest-prefix reuse feeds only the new text: nothing of the earlier turns
            assert session.last_plan.fed == len(TOKENIZER(text, add_special_tokens=False).input_ids), turn
        # every token the user has seen is in the history, and nothing else (an ending EOS is not)
        assert TOKENIZER.decode(session.tokens[0], skip_special_tokens=False) == "<bos>" + said


# ----- pad ids in a history without a mask --------------------------------------------------
def answer_with_pad(model, ids):
    """The first answer, made to contain the pad id 0 (a bias on 0 after the first new token)."""
    first = int(model.generate(ids, max_new_tokens=1, do_sample=False)[0, -1])
    return dict(max_new_tokens=4, sequence_bias={(first, 0): 100.0})


def left_padded():
    ids = prompt(7, batch=2)
    ids[1, :3] = 0
    return ids


PAD_CASES = {
    "a pad id inside a prompt": (lambda: prompt(9).index_fill_(1, torch.tensor([3]), 0), {}),
    "a batch left-padded with pad ids": (left_padded, {}),
    "pad id equal to an EOS id: nothing is masked": (lambda: prompt(9).index_fill_(1, torch.tensor([2]), 0),
                                                     dict(eos_token_id=[0, 2])),
    "a pad id set per call": (lambda: prompt(9).index_fill_(1, torch.tensor([4]), 7), dict(pad_token_id=7)),
    "no pad id at all": (lambda: prompt(9).index_fill_(1, torch.tensor([4]), 0), dict(pad_token_id=None)),
}


@pytest.mark.parametrize("case", sorted(PAD_CASES))
def test_a_history_without_a_mask_is_masked_as_generate_masks_it(model, case):
    make, options = PAD_CASES[case]
    ids = make()
    session = Session(model)
    assert_same_answer(kv(session, ids, max_new_tokens=4, **options), plain(model, ids, max_new_tokens=4, **options))
    more = torch.cat([ids, torch.full((ids.shape[0], 1), 5), prompt(3, seed=4, batch=ids.shape[0])], 1)
    assert_same_answer(kv(session, more, max_new_tokens=4, **options),
                       plain(model, more, max_new_tokens=4, **options))


def test_an_answer_holding_the_pad_id_is_masked_on_the_next_turn(model):
    ids = prompt(6)
    first = answer_with_pad(model, ids)
    session = Session(model)
    answer, _ = kv(session, ids, **first)
    assert 0 in answer[0, :-1].tolist(), answer  # the pad id was processed as a real token on turn one
    assert_same_answer((answer, _), plain(model, ids, **first))
    turn2 = torch.cat([ids, answer, prompt(4, seed=3)], 1)  # fed back without a mask, as model.generate allows
    assert_same_answer(kv(session, turn2, max_new_tokens=5), plain(model, turn2, max_new_tokens=5))
    assert session.last_plan.reused <= ids.shape[1] + answer[0].tolist().index(0)  # it never reused that slot


def test_an_explicit_mask_keeps_pad_ids_as_tokens(model):
    ids = prompt(9).index_fill_(1, torch.tensor([3]), 0)
    ones = torch.ones_like(ids)
    assert_same_answer(kv(Session(model), ids, ones, max_new_tokens=4), plain(model, ids, ones, max_new_tokens=4))


@settings(max_examples=12, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.lists(st.sampled_from([0, 0, 5, 9, 17, 33, 64, 90]), min_size=1, max_size=5),
                      min_size=2, max_size=3))
def test_turns_with_pads_sprinkled_in_match_plain_generate(turns):
    model = tiny_model("gemma3_text")  # cached: the same instance every example
    session, history = Session(model), torch.tensor([[1]])
    for words in turns:
        history = torch.cat([history, torch.tensor([words])], 1)
        ours, reference = session.generate(history, max_new_tokens=2, do_sample=False), \
            plain(model, history, max_new_tokens=2)[0]
        assert torch.equal(ours, reference), (history.tolist(), ours.tolist(), reference.tolist())
        history = torch.cat([history, ours], 1)


def test_a_reply_after_a_trailing_pad_is_not_kept_at_generate_s_positions():
    """``generate`` numbers the tokens after a history's trailing pad from the pad's position 0, where
    a fresh run of the longer history numbers them on; the state keeps only the history, and the next
    turn equals plain transformers (a hypothesis example found this)."""
    model = tiny_model("llama")
    session = Session(model, canonical_chunk=0)  # longest-prefix reuse: the plan shows what was kept
    history = prompt(6).index_fill_(1, torch.tensor([5]), 0)  # ends in a pad id: masked
    reply, _ = kv(session, history, max_new_tokens=3)
    assert session.state.tokens_seen == history.shape[1]
    longer = torch.cat([history, reply, prompt(2, seed=6)], 1)
    assert_same_answer(kv(session, longer, max_new_tokens=3), plain(model, longer, max_new_tokens=3))
    assert session.last_plan.reused == history.shape[1]


def test_a_model_whose_forward_takes_no_mask_keeps_pad_ids_as_tokens():
    """xLSTM's forward has no ``attention_mask``, so generate builds none: a pad id is a token there."""
    model = tiny_model("xlstm")
    ids = prompt(7).index_fill_(1, torch.tensor([3]), 0)
    session = Session(model)
    assert torch.equal(session.generate(ids, max_new_tokens=3, do_sample=False), plain(model, ids, max_new_tokens=3)[0])
    assert bool(session.state.mask.all())
