"""Non-uniform head budgets by measured sensitivity (model glue around ``ops/budgets.py``).

For each context, every compacted (layer, KV head) is compacted once at each level ratio (one
compression of the whole cache per level); a cache with head (l, h) alone at level r and every other
head at the start ratio is then assembled from those entries, no solve repeated. The loss of a head at
a level is the change, against the all-at-start cache, of the mean negative log-likelihood per token of
the full-context model's own greedy answers to the context's questions (the papers' log-perplexity),
averaged over contexts. ``greedy_exchange`` then moves budget between heads while the additive loss
falls, and the shares are the resulting ratios over their sum (the reference's JSON).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm import tqdm

from kvresearch.data import head_budgets
from kvresearch.methods.am_cache import HeadEntries, apply
from kvresearch.methods.attention_matching import AttentionMatching
from kvresearch.models.cache import RaggedCache
from kvresearch.models.session import Session
from kvresearch.ops import budgets
from kvresearch.prompts import Prompt

HeadKey = budgets.HeadKey


def head_entries(cache: RaggedCache, layer: int, head: int) -> HeadEntries:
    """What one head of a compacted cache holds: positions, biases and values."""
    lay = cache.ragged[layer]
    rows = lay.head_rows(head)
    return HeadEntries(lay.pos[rows].cpu(), lay.bias[rows].double().cpu(), lay.v[rows].double().cpu())


@dataclass
class Context:
    """One context of the search: its prompts (one per question) and the full cache's answers."""

    prompts: Sequence[Prompt]
    answers: list[list[int]] = field(default_factory=list)


def full_answers(session: Session, context: Context, new_tokens: int) -> None:
    """The full-context model's greedy answers, one per question."""
    cache = session.dense_prefill(context.prompts[0].context_ids).cache
    context.answers = [session.generate(cache, p.question_ids, new_tokens).tokens for p in context.prompts]


def mean_nll(session: Session, cache: RaggedCache, context: Context) -> float:
    """Mean NLL per token of the full answers under ``cache``."""
    values = [
        session.answer_nll(cache, p.question_ids, a) for p, a in zip(context.prompts, context.answers, strict=True) if a
    ]
    return sum(values) / max(len(values), 1)


def sensitivities(
    session: Session, method: AttentionMatching, contexts: Sequence[Context], levels: Sequence[float], start: float
) -> dict[tuple[HeadKey, float], float]:
    """Loss change of every (head, level), averaged over the contexts (see the module docstring)."""
    heads = [
        (i, h)
        for i, spec in enumerate(session.adapter.layers)
        if spec.sliding_window is None
        for h in range(session.adapter.num_kv_heads)
    ]
    total: dict[tuple[HeadKey, float], float] = {}
    for context in contexts:
        prompt = context.prompts[0]
        prefill = session.dense_prefill(prompt.context_ids)
        at = {}
        for r in levels:
            cache = replace(method, keep_ratio=r).compress(session, prompt)
            at[r] = {k: head_entries(cache, *k) for k in heads}
        base_cache = assemble(prefill.ragged(), at[start], heads)
        base = mean_nll(session, base_cache, context)
        for key in tqdm(heads, desc="head sensitivities", leave=False):
            for r in levels:
                if r == start:
                    total[(key, r)] = total.get((key, r), 0.0)
                    continue
                chosen = dict(at[start])
                chosen[key] = at[r][key]
                loss = mean_nll(session, assemble(prefill.ragged(), chosen, heads), context) - base
                total[(key, r)] = total.get((key, r), 0.0) + loss / len(contexts)
    return total


def assemble(cache: RaggedCache, chosen: dict[HeadKey, HeadEntries], heads: Sequence[HeadKey]) -> RaggedCache:
    """``cache`` (the whole context, dense order) with each compacted head holding ``chosen[head]``."""
    for layer in sorted({i for i, _ in heads}):
        apply(cache.ragged[layer], [chosen[(layer, h)] for h in range(cache.ragged[layer].lengths.shape[0])])
    return cache


def allocate(loss: dict[tuple[HeadKey, float], float], levels: Sequence[float], start: float) -> dict[str, Any]:
    """Greedy exchange on the measured losses; the shares and the per-head ratios."""
    heads = sorted({k for k, _ in loss})
    ratios = budgets.greedy_exchange(lambda h, r: loss[(h, r)], heads, levels, start)
    shares = {h: r / sum(ratios.values()) for h, r in ratios.items()}
    predicted = sum(loss[(h, r)] for h, r in ratios.items())
    return {
        "shares": head_budgets.dump_shares(shares),
        "ratios": head_budgets.dump_shares(ratios),
        "predicted_loss_change": predicted,
    }
