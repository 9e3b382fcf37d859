"""Bootstrap intervals: coverage of a known mean, degenerate inputs, pairing."""

from __future__ import annotations

import numpy as np
import pytest

from kvresearch.stats import bootstrap_mean, by_id, context_of, paired_difference


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


def test_a_cluster_bootstrap_resamples_whole_contexts_and_singletons_give_the_plain_bootstrap() -> None:
    rng = np.random.default_rng(3)
    # 6 contexts of 5 questions each; questions of one context move together (a shared context effect).
    effect = np.repeat(rng.normal(0, 1, 6), 5)
    values = effect + rng.normal(0, 0.1, 30)
    labels = [f"quality#{i // 5}/{i % 5}" for i in range(30)]
    plain = bootstrap_mean(values)
    assert bootstrap_mean(values, clusters=list(range(30))) == plain  # every answer its own cluster
    clustered = bootstrap_mean(values, clusters=[context_of(x) for x in labels])
    assert clustered.mean == pytest.approx(values.mean())
    assert clustered.high - clustered.low > 1.5 * (plain.high - plain.low)  # 6 effective samples, not 30
    # brute force: the same draws of whole contexts, pooled means, percentiles
    sums, counts = values.reshape(6, 5).sum(1), np.full(6, 5.0)
    drawn = np.random.default_rng(0).integers(0, 6, size=(2000, 6))
    means = sums[drawn].sum(1) / counts[drawn].sum(1)
    assert clustered.low == pytest.approx(np.quantile(means, 0.025))
    assert clustered.high == pytest.approx(np.quantile(means, 0.975))
    assert np.isnan(bootstrap_mean(values[:5], clusters=[0] * 5).low)  # one context: no interval
    two = bootstrap_mean(values[:10], clusters=[i // 5 for i in range(10)])
    assert np.isnan(two.low) and two.mean == pytest.approx(values[:10].mean())  # two articles: the mean alone


def test_answers_are_paired_by_id_whatever_their_order() -> None:
    ours = {"q#1": 1.0, "q#0": 0.0, "q#2": 1.0}
    theirs = {"q#2": 0.0, "q#0": 0.0, "q#3": 1.0}
    mean, diff = by_id(ours, theirs)
    assert mean.n == 3 and mean.mean == pytest.approx(2 / 3)
    assert diff is not None and diff.n == 2 and diff.mean == pytest.approx(0.5)  # q#0: 0, q#2: +1
    assert context_of("quality#12/3") == "quality#12" and context_of("ruler_niah#4") == "ruler_niah#4"
    assert by_id(ours, {"other": 1.0})[1] is None
