"""Per-head budgets for compaction (pure logic): sizes and the greedy exchange.

Sizes come from shares (``data/head_budgets.py`` reads and writes the file) or from key scores; the
greedy exchange allocates a fixed total by measured sensitivities.

A budget file maps ``"L{layer}H{kv_head}"`` to the head's share of the total (the shares sum to 1), the
reference code's format. At keep ratio r over a span of n tokens with H compacted heads in total, head
(l, h) keeps ``int(share * r * n * H)`` entries (the reference's formula), at least 1 and at most n.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from kvresearch.errors import KVResearchError

HeadKey = tuple[int, int]  # (layer, kv_head)


def sizes_from_shares(
    shares: dict[HeadKey, float], heads: Sequence[HeadKey], keep_ratio: float, n: int
) -> dict[HeadKey, int]:
    """Entries kept per head: ``int(share * keep_ratio * n * len(heads))`` clipped to [1, n]."""
    missing = [f"L{layer}H{head}" for layer, head in heads if (layer, head) not in shares]
    if missing:
        raise KVResearchError(f"the budget file has no share for {', '.join(missing[:5])}: made for another model?")
    total = keep_ratio * n * len(heads)
    return {h: min(n, max(1, int(shares[h] * total))) for h in heads}


def sizes_from_scores(scores: dict[HeadKey, torch.Tensor], keep_ratio: float) -> dict[HeadKey, int]:
    """One threshold over all given heads: the top ``int(keep_ratio * total keys)`` scores; each head at least 1."""
    flat = torch.cat([s.flatten().float() for s in scores.values()])
    budget = max(len(scores), int(keep_ratio * flat.numel()))
    threshold = flat.topk(budget).values[-1]
    return {h: max(1, int((s.float() >= threshold).sum())) for h, s in scores.items()}


def shares_of(sizes: dict[HeadKey, int]) -> dict[HeadKey, float]:
    """Sizes as shares of their total."""
    total = sum(sizes.values())
    return {h: n / total for h, n in sizes.items()}


def greedy_exchange(
    loss: Callable[[HeadKey, float], float],
    heads: Sequence[HeadKey],
    levels: Sequence[float],
    start: float,
    max_moves: int = 100_000,
) -> dict[HeadKey, float]:
    """Allocate a fixed total ratio over heads by greedy exchange on per-head loss curves.

    ``loss(head, ratio)`` is the measured loss when that head alone sits at ``ratio`` (others at ``start``);
    ``levels`` are evenly spaced ratios containing ``start``, where every head begins. A move lowers the
    head whose step down costs least by one level and raises the head whose step up gains most by one
    level (the total stays fixed); moves repeat while the gain exceeds the cost (the loss, additive over
    heads, falls). Returns each head's ratio.
    """
    levels = sorted(levels)
    steps = [b - a for a, b in itertools.pairwise(levels)]
    if start not in levels or (steps and max(steps) - min(steps) > 1e-9 * max(steps)):
        raise KVResearchError(f"levels must be evenly spaced and contain the start ratio {start}, got {levels}.")
    at = {h: levels.index(start) for h in heads}
    for _ in range(max_moves):
        downs = sorted((loss(h, levels[at[h] - 1]) - loss(h, levels[at[h]]), h) for h in heads if at[h] > 0)
        ups = sorted(
            ((loss(h, levels[at[h]]) - loss(h, levels[at[h] + 1]), h) for h in heads if at[h] < len(levels) - 1),
            reverse=True,
        )
        pairs = [(gain - cost, low, high) for cost, low in downs[:2] for gain, high in ups[:2] if low != high]
        if not pairs:
            break
        margin, low, high = max(pairs)
        if margin <= 1e-12:
            break
        at[low] -= 1
        at[high] += 1
    return {h: levels[at[h]] for h in heads}
