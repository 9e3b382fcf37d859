"""Benchmark metrics, per answer in [0, 1] (tables report the mean x 100), as the official scripts define them.

Every metric takes ``(prediction, references, **options)`` and scores against the best reference.

* RULER: ``string_match_all``, ``string_match_part`` (NVIDIA/RULER ``eval/synthetic/constants.py``);
* LongBench v1 (THUDM/LongBench ``metrics.py`` and ``eval.py``): ``qa_f1`` (SQuAD normalisation: lower
  case, punctuation, articles, whitespace), ``rouge_l`` (the ``rouge`` package the official script uses),
  ``classification`` (with the task's ``all_classes``; the official function's quirks kept, see there),
  ``retrieval`` ("Paragraph N"), ``count``, ``code_sim`` (fuzzywuzzy's ``fuzz.ratio`` as the official
  environment computes it: difflib's SequenceMatcher, rounded); ``first_line=True`` keeps the prediction's
  first line first (trec, triviaqa, samsum, lsht in the official ``scorer``);
* multiple choice: ``choice_v2`` (LongBench v2's ``extract_answer``: "The correct answer is (X)"),
  ``choice_letter`` (the Attention Matching code's ``parse_model_choice``, for QuALITY and LongHealth).
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

_CONTROL = re.compile(r"[\x00-\x1f]")


# ----------------------------------------------------------------------------------------------- RULER
def clean(prediction: str) -> str:
    """RULER's post-processing: strip, control characters to newlines."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str], **_: Any) -> float:
    """Share of the references found (case-insensitive) in the prediction."""
    p = clean(prediction).lower()
    return sum(r.lower() in p for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str], **_: Any) -> float:
    """1 if any reference is found in the prediction."""
    p = clean(prediction).lower()
    return float(any(r.lower() in p for r in references))


# ------------------------------------------------------------------------------------------ LongBench v1
def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD's normalisation)."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _f1(prediction: list[str], reference: list[str]) -> float:
    same = sum((Counter(prediction) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1_one(prediction: str, reference: str, **_: Any) -> float:
    """Token F1 of the normalised prediction and reference."""
    return _f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def rouge_l_one(prediction: str, reference: str, **_: Any) -> float:
    """ROUGE-L F of the ``rouge`` package (0 where it raises, e.g. on an empty prediction)."""
    from rouge import Rouge

    try:
        return float(Rouge().get_scores([prediction], [reference], avg=True)["rouge-l"]["f"])
    except Exception:  # the official script's bare except: empty or all-punctuation text
        return 0.0


def classification_one(prediction: str, reference: str, all_classes: Sequence[str] = (), **_: Any) -> float:
    """The official classification score, quirks included.

    Classes named in the prediction count, minus those that are substrings of the reference (the official
    loop removes from the list it iterates, so it can skip one); since ``em_match_list != 0`` is always
    true in the official code, the difflib fallback is never reached and an empty match scores 0.
    """
    matches = _official_removal([c for c in all_classes if c in prediction], reference)
    return 1.0 / len(matches) if reference in matches else 0.0


def _official_removal(matches: list[str], reference: str) -> list[str]:
    """``for t in lst: if t in ref and t != ref: lst.remove(t)`` exactly, skips included."""
    out = list(matches)
    i = 0
    while i < len(out):
        term = out[i]
        if term in reference and term != reference:
            out.remove(term)  # removes the first equal item; the next item slides into index i and is skipped
        i += 1
    return out


def _count_hits(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return 0.0 if not numbers else sum(n == target for n in numbers) / len(numbers)


def retrieval_one(prediction: str, reference: str, **_: Any) -> float:
    """Share of the numbers in the prediction that name the reference's paragraph."""
    return _count_hits(prediction, re.findall(r"Paragraph (\d+)", reference)[0])


def count_one(prediction: str, reference: str, **_: Any) -> float:
    """Share of the numbers in the prediction equal to the reference count."""
    return _count_hits(prediction, str(reference))


def fuzz_ratio(a: str, b: str) -> int:
    """Fuzzywuzzy's ``fuzz.ratio`` without python-Levenshtein (LongBench's environment): difflib, rounded."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return round(100 * difflib.SequenceMatcher(None, a, b).ratio())


def code_sim_one(prediction: str, reference: str, **_: Any) -> float:
    """Edit similarity of the first prediction line that is not a comment or a code fence."""
    lines = prediction.lstrip("\n").split("\n")
    first = next((line for line in lines if "`" not in line and "#" not in line and "//" not in line), "")
    return fuzz_ratio(first, reference) / 100


def best_of(one: Callable[..., float]) -> Callable[..., float]:
    """A per-reference metric as LongBench scores it: the best over references, first line kept on request."""

    def score(prediction: str, references: Sequence[str], first_line: bool = False, **options: Any) -> float:
        if first_line:
            prediction = prediction.lstrip("\n").split("\n")[0]
        return max((one(prediction, r, **options) for r in references), default=0.0)

    score.__doc__ = one.__doc__
    return score


# ------------------------------------------------------------------------------------------ multiple choice
def extract_choice_v2(response: str) -> str | None:
    """LongBench v2's ``extract_answer``: the letter of "The correct answer is (X)" or "... is X"."""
    response = response.replace("*", "")
    match = re.search(r"The correct answer is \(([A-D])\)", response) or re.search(
        r"The correct answer is ([A-D])", response
    )
    return match.group(1) if match else None


def parse_choice(answer: str, options: int = 5) -> str | None:
    """The Attention Matching code's ``parse_model_choice``, returning the letter (or None)."""
    if "<think>" in answer and "</think>" not in answer:
        return None
    if "</think>" in answer:
        answer = answer.split("</think>")[-1].strip()
    elif "<think>" not in answer:
        answer = next((line.strip() for line in reversed(answer.splitlines()) if line.strip()), answer)
    letters = [chr(97 + i) for i in range(options)]
    lower = answer.lower()
    for pattern in ("answer:", "answer is", "correct option is"):
        if pattern in lower:
            candidate = lower.split(pattern)[-1].strip().lstrip(":").strip().rstrip(".").strip().replace("*", "")
            if candidate and candidate[0] in letters:
                return candidate[0].upper()
    first = lower.split(".")[0].strip().replace("*", "")
    if first in letters:
        return first.upper()
    upper = "".join(chr(65 + i) for i in range(options))
    found = re.findall(r"(?<![a-zA-Z])([" + upper + r"])(?![a-zA-Z])", answer)
    return found[-1] if found else None


def choice_v2(prediction: str, references: Sequence[str], **_: Any) -> float:
    """1 if the extracted letter is the reference letter."""
    return float(extract_choice_v2(prediction) in references)


def choice_letter(prediction: str, references: Sequence[str], options: int = 5, **_: Any) -> float:
    """1 if the parsed letter is the reference letter."""
    return float(parse_choice(prediction, options) in references)


# ------------------------------------------------------------------------------------------ AIME
def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[begin : i - 1] if depth == 0 else None


def extract_aime(text: str) -> int | None:
    r"""The answer of an AIME response: the integer in the last ``\boxed{}``, else the final integer 0-999."""
    boxed = last_boxed(text)
    if boxed is not None:
        plain = re.sub(r"\\text\{([^}]*)\}|\{,\}|\\[!,;: ]|[\s$,]", lambda m: m.group(1) or "", boxed)
        plain = re.sub(r"\s", "", plain)
        return int(plain) if re.fullmatch(r"\d+", plain) else None
    finals = [int(n) for n in re.findall(r"(?<![\d.])\d+(?!\d|\.\d)", text) if int(n) <= 999]
    return finals[-1] if finals else None


def aime(prediction: str, references: Sequence[str], **_: Any) -> float:
    """1 if the extracted integer equals the answer."""
    found = extract_aime(prediction)
    return float(found is not None and any(found == int(r) for r in references))


METRICS: dict[str, Callable[..., float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "qa_f1": best_of(qa_f1_one),
    "rouge_l": best_of(rouge_l_one),
    "classification": best_of(classification_one),
    "retrieval": best_of(retrieval_one),
    "count": best_of(count_one),
    "code_sim": best_of(code_sim_one),
    "choice_v2": choice_v2,
    "choice_letter": choice_letter,
    "aime": aime,
}
