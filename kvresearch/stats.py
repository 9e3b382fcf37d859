"""Statistics for result tables: seeded bootstrap intervals of a mean and of a paired difference.

Percentile bootstrap, 95% by default; the same seed gives the same interval. Values are plain sequences of
per-answer scores. Answers that share a context (the questions of one QuALITY article, the samples of one
AIME problem) are not independent: give their ``clusters`` (one label per value) and whole contexts are
resampled with replacement (a cluster bootstrap), the mean being the pooled mean of the drawn answers;
with fewer than ``MIN_CONTEXTS`` contexts there is no interval (two articles do not make a distribution).
Without clusters every answer is its own cluster (the plain bootstrap).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

MIN_CONTEXTS = 5  # fewer contexts than this (some holding several answers): no interval, the mean alone
QUESTION_OF_SAMPLE = re.compile(r"(?P<sample>.+#\d+)/\d+")  # record ids: <group>#<index>[/<question>]


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


def context_of(answer_id: str) -> str:
    """The context an answer belongs to: its sample's key (``quality#0`` for ``quality#0/3``), else its id."""
    found = QUESTION_OF_SAMPLE.fullmatch(answer_id)
    return found["sample"] if found else answer_id


def bootstrap_mean(
    values: Sequence[float] | np.ndarray,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    clusters: Sequence[Hashable] | None = None,
) -> Interval:
    """The mean of ``values`` with a percentile bootstrap interval (NaN bounds for fewer than 2 clusters).

    Args:
        values: one value per answer.
        level: the interval's coverage.
        resamples: bootstrap draws.
        seed: the generator's seed (the same seed, the same interval).
        clusters: one label per value; values with one label are resampled together (None: each alone).
    """
    x = np.asarray(values, dtype=np.float64)
    if len(x) == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    if clusters is None:
        sums, counts = x, np.ones_like(x)  # each answer its own cluster
    else:
        if len(clusters) != len(x):
            raise ValueError(f"{len(clusters)} cluster labels for {len(x)} values")
        labels = {label: i for i, label in enumerate(dict.fromkeys(clusters))}
        index = np.fromiter((labels[c] for c in clusters), dtype=np.int64, count=len(x))
        sums = np.bincount(index, weights=x).astype(np.float64)
        counts = np.bincount(index, weights=np.ones_like(x)).astype(np.float64)
    if len(sums) == 1 or (len(sums) < len(x) and len(sums) < MIN_CONTEXTS):
        return Interval(float(x.mean()), float("nan"), float("nan"), len(x))  # too few contexts to resample
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, len(sums), size=(resamples, len(sums)))
    means = sums[drawn].sum(axis=1) / counts[drawn].sum(axis=1)
    tail = (1 - level) / 2
    return Interval(float(x.mean()), float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail)), len(x))


def paired_difference(
    a: Sequence[float],
    b: Sequence[float],
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    clusters: Sequence[Hashable] | None = None,
) -> Interval:
    """Mean of ``a - b`` over paired answers with its bootstrap interval (the same answers, in the same order)."""
    if len(a) != len(b):
        raise ValueError(f"paired values differ in length: {len(a)} and {len(b)}")
    diff = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    return bootstrap_mean(diff, level, resamples, seed, clusters)


def by_id(
    values: dict[str, float], reference: dict[str, float] | None = None, level: float = 0.95
) -> tuple[Interval, Interval | None]:
    """The mean of per-answer ``values`` (id -> value) and the paired difference against ``reference``.

    The difference is over the answers both have, matched by id (None without a reference or a shared
    answer); both are resampled by context (:func:`context_of`).
    """
    ids = list(values)  # in the run's order
    mean = bootstrap_mean([values[i] for i in ids], level, clusters=[context_of(i) for i in ids])
    if reference is None:
        return mean, None
    shared = sorted(set(values) & set(reference))
    if not shared:
        return mean, None
    a, b = [values[i] for i in shared], [reference[i] for i in shared]
    return mean, paired_difference(a, b, level, clusters=[context_of(i) for i in shared])
