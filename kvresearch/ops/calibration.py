"""Threshold calibration: the log-space KVzap threshold that prunes a target share of a set of contexts.

KVzap prunes an entry when it has left the sliding window and its predicted score is below the threshold
tau, so on one context the prune ratio is ``#(eligible scores < tau) / entries``. Thresholds do not transfer
between models or surrogates (their score scales differ), so a comparison at matched compression calibrates
tau on held-out contexts: the tau whose mean prune ratio over them is the target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Calibration:
    """A calibrated threshold and the mean prune ratio it gives on the calibration contexts."""

    threshold: float
    target: float
    achieved: float
    contexts: int


def prune_ratios(eligible: Sequence[torch.Tensor], entries: Sequence[int], threshold: float) -> torch.Tensor:
    """Per context: the share of its ``entries`` that ``threshold`` prunes.

    Args:
        eligible: per context, the scores of the entries outside the window, any shape (flattened).
        entries: per context, all its entries (layers x KV heads x tokens), the denominator.
        threshold: log-space tau; a score strictly below it is pruned.
    """
    return torch.tensor(
        [float((s < threshold).sum()) / max(n, 1) for s, n in zip(eligible, entries, strict=True)],
        dtype=torch.float64,
    )


def calibrate_threshold(eligible: Sequence[torch.Tensor], entries: Sequence[int], target: float) -> Calibration:
    """The threshold whose mean prune ratio over the contexts is closest to ``target`` (0 <= target < 1).

    The mean prune ratio is a step function of tau that jumps at each eligible score; the answer is a
    midpoint between two consecutive distinct scores (or just below the smallest), found by bisection
    over the sorted scores. A target above the largest reachable ratio (everything outside the window)
    gives the threshold that prunes all of it.
    """
    if not 0.0 <= target < 1.0:
        raise ValueError(f"target prune ratio must be in [0, 1), got {target}")
    if not eligible:
        raise ValueError("no calibration contexts")
    flat = [s.detach().reshape(-1).double().cpu() for s in eligible]
    values = torch.unique(torch.cat(flat))  # sorted
    if values.numel() == 0:
        return Calibration(0.0, target, 0.0, len(flat))
    # candidates[k] prunes exactly the scores below values[k] (k = 0: nothing; k = len: everything)
    gaps = (values[1:] + values[:-1]) / 2
    candidates = torch.cat([values[:1] - 1.0, gaps, values[-1:] + 1.0])

    def mean_at(k: int) -> float:
        return float(prune_ratios(flat, entries, float(candidates[k])).mean())

    lo, hi = 0, len(candidates) - 1  # mean_at is non-decreasing in k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mean_at(mid) <= target:
            lo = mid
        else:
            hi = mid
    best = min((lo, hi), key=lambda k: (abs(mean_at(k) - target), k))
    return Calibration(float(candidates[best]), target, mean_at(best), len(flat))
