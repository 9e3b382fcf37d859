"""Benchmark metrics, per sample in [0, 1] (RULER reports the mean x 100)."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def clean(prediction: str) -> str:
    """RULER's post-processing: strip, control characters to newlines."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Share of the references found (case-insensitive) in the prediction."""
    p = clean(prediction).lower()
    return sum(r.lower() in p for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 if any reference is found in the prediction."""
    p = clean(prediction).lower()
    return float(any(r.lower() in p for r in references))


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}
