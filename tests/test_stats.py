"""Bootstrap intervals: coverage of a known mean, degenerate inputs, pairing."""

from __future__ import annotations

import numpy as np
import pytest

from kvresearch.stats import bootstrap_mean, paired_difference


def test_bootstrap_interval_brackets_the_mean_and_covers_the_truth_about_95_percent() -> None:
    rng = np.random.default_rng(1)
    covered = 0
    for trial in range(200):
        x = rng.binomial(1, 0.3, size=60).astype(float)  # per-answer scores of a 30% method
        ci = bootstrap_mean(x, resamples=500, seed=trial)
        assert ci.low <= ci.mean <= ci.high and ci.n == 60
        covered += ci.low <= 0.3 <= ci.high
    assert 0.88 <= covered / 200 <= 0.99  # a percentile bootstrap of a mean: close to the nominal 95%
    assert bootstrap_mean([0.2, 0.9, 0.4], seed=3) == bootstrap_mean([0.2, 0.9, 0.4], seed=3)  # seeded


def test_degenerate_inputs_and_paired_differences() -> None:
    assert bootstrap_mean([]).n == 0 and np.isnan(bootstrap_mean([]).mean)
    one = bootstrap_mean([0.5])
    assert one.mean == 0.5 and np.isnan(one.low)
    same = bootstrap_mean([1.0] * 10)
    assert same.low == same.high == 1.0
    d = paired_difference([1, 1, 0, 1], [1, 0, 0, 1])
    assert d.mean == pytest.approx(0.25) and d.low >= 0.0
    assert bootstrap_mean([0.1, 0.2]).scaled(100).mean == pytest.approx(15.0)
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference([1, 2], [1])


def test_bootstrap_interval_of_a_known_sample_matches_the_exact_bootstrap_distribution() -> None:
    """n=5: all 5^5 equally likely resamples enumerated give the exact percentile interval of the bootstrap."""
    import itertools

    x = np.array([0.0, 1.0, 1.0, 3.0, 7.0])
    means = np.array([np.mean(x[list(idx)]) for idx in itertools.product(range(5), repeat=5)]).round(9)
    values, counts = np.unique(means, return_counts=True)
    cdf = np.cumsum(counts) / len(means)  # P(mean <= value) at each distinct value
    exact_low, exact_high = values[np.searchsorted(cdf, 0.025)], values[np.searchsorted(cdf, 0.975)]
    for q in (0.025, 0.975):  # neither quantile sits on a jump of the distribution: the estimate is stable
        assert np.min(np.abs(cdf - q)) > 0.002
    ci = bootstrap_mean(x, resamples=200_000, seed=7)
    assert ci.mean == pytest.approx(2.4)
    assert ci.low == pytest.approx(exact_low) and ci.high == pytest.approx(exact_high)
