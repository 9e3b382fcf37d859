"""Statistics for result tables: seeded bootstrap intervals of a mean and of a paired difference.

Percentile bootstrap over samples (resampling answers with replacement), 95% by default; the same seed
gives the same interval. Values are plain sequences of per-answer scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A mean and its bootstrap interval."""

    mean: float
    low: float
    high: float
    n: int

    def scaled(self, factor: float) -> Interval:
        """The same interval times ``factor`` (e.g. x100 for scores)."""
        return Interval(self.mean * factor, self.low * factor, self.high * factor, self.n)


def bootstrap_mean(
    values: Sequence[float] | np.ndarray, level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> Interval:
    """The mean of ``values`` with a percentile bootstrap interval (NaN bounds for fewer than 2 values)."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    if len(x) == 1:
        return Interval(float(x[0]), float("nan"), float("nan"), 1)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    tail = (1 - level) / 2
    return Interval(float(x.mean()), float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail)), len(x))


def paired_difference(
    a: Sequence[float], b: Sequence[float], level: float = 0.95, resamples: int = 2000, seed: int = 0
) -> Interval:
    """Mean of ``a - b`` over paired answers with its bootstrap interval (the same answers in both)."""
    if len(a) != len(b):
        raise ValueError(f"paired values differ in length: {len(a)} and {len(b)}")
    return bootstrap_mean(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64), level, resamples, seed)
