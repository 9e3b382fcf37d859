"""Benchmark metrics against their official definitions, edge cases included.

Expected values are computed by hand from each definition (and were checked against the official scripts,
THUDM/LongBench ``metrics.py``/``eval.py``/``pred.py`` and the Attention Matching code's parser, run on the
same pairs; see docs/evaluation.md). Code similarity is also compared live with fuzzywuzzy, which the
official environment uses (without python-Levenshtein, so difflib underneath).
"""

from __future__ import annotations

import pytest

from kvresearch.benchmarks.metrics import (
    METRICS,
    extract_choice_v2,
    fuzz_ratio,
    normalize_answer,
    parse_choice,
)


@pytest.mark.parametrize(
    ("prediction", "references", "expected"),
    [
        ("The cat sat.", ["a cat sat down"], 0.8),  # articles and punctuation go; P = 1, R = 2/3
        ("", ["Paris"], 0.0),  # empty prediction
        ("Paris, France", ["paris", "Lyon, France"], 2 / 3),  # the best reference: P = 1/2, R = 1
        ("an apple an apple", ["apple"], 2 / 3),  # repeated tokens count once per match: P = 1/2, R = 1
        ("unanswerable", ["Unanswerable"], 1.0),
        ("!!!", ["yes"], 0.0),  # nothing left after normalisation
    ],
)
def test_qa_f1_follows_squad_normalisation(prediction, references, expected) -> None:
    assert METRICS["qa_f1"](prediction, references) == pytest.approx(expected)
    assert normalize_answer("  The  Quick, brown fox!  ") == "quick brown fox"


def test_qa_f1_first_line_rule() -> None:
    assert METRICS["qa_f1"]("\n\nParis\nLondon Rome", ["Paris"], first_line=True) == 1.0
    assert METRICS["qa_f1"]("\n\nParis\nLondon Rome", ["Paris"]) == pytest.approx(0.5)


def test_rouge_l_is_the_official_package_with_zero_on_failure() -> None:
    # The official rouge_score gives 0.79999999500 here (the package's summary-level ROUGE-L), not the 5/6
    # of a plain LCS over the six tokens.
    score = METRICS["rouge_l"]("the cat sat on the mat", ["the cat is on the mat"])
    assert score == pytest.approx(0.79999999500, abs=1e-9)
    assert METRICS["rouge_l"]("", ["a summary"]) == 0.0  # the package raises on an empty hypothesis
    assert METRICS["rouge_l"]("same words", ["other text", "same words"]) == pytest.approx(0.999999995, abs=1e-12)


@pytest.mark.parametrize(
    ("prediction", "reference", "classes", "expected"),
    [
        ("Type: LOC", "LOC", ["LOC", "HUM", "NUM"], 1.0),
        ("LOC or HUM", "LOC", ["LOC", "HUM", "NUM"], 0.5),  # two classes named: half credit
        ("nothing", "LOC", ["LOC", "HUM"], 0.0),  # no class named: the official code never reaches its fallback
        ("Entity: Food", "Food", ["Food", "Food and drink"], 1.0),
        # "Food" is a substring of the reference "Food and drink" and is removed; the official loop then skips
        # the next match, so both "Food and drink" and "Food item" stay: 1/2.
        ("Food and drink, Food item", "Food and drink", ["Food", "Food item", "Food and drink"], 0.5),
    ],
)
def test_classification_keeps_the_official_quirks(prediction, reference, classes, expected) -> None:
    assert METRICS["classification"](prediction, [reference], all_classes=classes) == pytest.approx(expected)


def test_retrieval_and_count_share_the_number_rule() -> None:
    assert METRICS["retrieval"]("Paragraph 12", ["Paragraph 12"]) == 1.0
    assert METRICS["retrieval"]("Paragraph 12 or Paragraph 3", ["Paragraph 3"]) == 0.5
    assert METRICS["retrieval"]("no idea", ["Paragraph 3"]) == 0.0
    assert METRICS["count"]("There are 7 unique paragraphs out of 9", ["7"]) == 0.5
    assert METRICS["count"]("", ["7"]) == 0.0


def test_code_similarity_is_fuzzywuzzy_ratio_on_the_first_code_line() -> None:
    fuzz = pytest.importorskip("fuzzywuzzy.fuzz")
    pairs = [
        ("return x + 1", "return x+1"),
        ("", "x = 1"),
        ("", ""),
        ("for i in range(10):", "for j in range(n):"),
        ("self.assertEqual(a, b)", "self.assertEqual(b, a)"),
        ("a" * 250 + "b", "a" * 240 + "c"),  # long enough for difflib's autojunk heuristic
    ]
    for a, b in pairs:
        assert fuzz_ratio(a, b) == fuzz.ratio(a, b), (a, b)
    prediction = "\n# a comment\n```python\nx = compute(y)  \nz = 2"
    assert METRICS["code_sim"](prediction, ["x = compute(y)"]) == 0.93  # the official code_sim_score
    assert fuzz.ratio("x = compute(y)  ", "x = compute(y)") == 93
    assert METRICS["code_sim"]("// only comments", ["x"]) == 0.0


@pytest.mark.parametrize(
    ("response", "letter"),
    [
        ("The correct answer is (B)", "B"),
        ("**The correct answer is C**", "C"),  # bold markers are dropped first
        ("The correct answer is (E)", None),  # E is not an option of LongBench v2
        ("I think B.", None),  # no parsable letter for the official pattern
        ("", None),
    ],
)
def test_longbench_v2_answer_extraction(response, letter) -> None:
    assert extract_choice_v2(response) == letter
    assert METRICS["choice_v2"](response, ["B"]) == float(letter == "B")


@pytest.mark.parametrize(
    ("answer", "letter"),
    [
        ("Let me think.\nThe answer is: D.", "D"),
        ("<think>long reasoning</think>\nB", "B"),
        ("<think>unfinished", None),
        ("c", "C"),
        ("Reasoning...\n**Answer: A**", "A"),
        ("Option (E) looks right", None),  # E is out of range for 4 options
        ("I do not know.", None),  # no letter
        ("A or B? I pick B", "B"),  # the last standalone capital
    ],
)
def test_attention_matching_letter_parser(answer, letter) -> None:
    assert parse_choice(answer, options=4) == letter
    assert METRICS["choice_letter"](answer, ["B"], options=4) == float(letter == "B")
    assert METRICS["choice_letter"](answer, ["A"], options=4) == float(letter == "A")


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("so the answer is \\boxed{070}.", 70),  # leading zeros, AIME's three-digit form
        ("first \\boxed{5}, then checked: \\boxed{\\text{ 12 }}", 12),  # the last box wins, \text unwrapped
        ("$\\boxed{ 204 }$", 204),
        ("\\fbox{7}", 7),
        ("\\boxed{\\frac{1}{2}}", None),  # not an integer: no answer (the final-integer rule does not apply)
        ("\\boxed{3.5}", None),
        ("\\boxed{1{,}000}", 1000),  # braces nested and balanced (then out of range for the match)
        ("we get 3.5, so 45 is it.", 45),  # no box: the final integer 0-999, decimals skipped
        ("1234 then 12", 12),  # 1234 is not a 1-3 digit answer
        ("the result is 1234", None),
        ("no digits at all", None),
        ("\\boxed{12", 12),  # an unclosed box is no box: the final integer
    ],
)
def test_aime_extraction(response: str, expected: int | None) -> None:
    from kvresearch.benchmarks.metrics import extract_aime

    assert extract_aime(response) == expected
    if expected is not None:
        assert METRICS["aime"](response, [str(expected)]) == 1.0
        assert METRICS["aime"](response, [str(expected + 1)]) == 0.0
