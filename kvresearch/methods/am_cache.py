"""What Attention Matching writes into the ragged cache, and the KVzip+ scores of its hybrid (model glue).

A compacted head is a ``HeadEntries``: the context positions it keeps, their logit biases and values.
``assemble`` joins the template tokens (kept as they are) and each chunk's compacted entries into one
head; ``apply`` writes a layer's heads into a ragged layer that holds the whole context in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvresearch.capture import chunked_oracle_scores
from kvresearch.models.cache import RaggedLayer
from kvresearch.models.session import Prefill, Session
from kvresearch.ops import am
from kvresearch.prompts import Prompt


@dataclass
class HeadEntries:
    """What one KV head keeps after compaction: absolute context positions, biases and values."""

    idx: torch.Tensor  # (t,) sorted positions in the context
    beta: torch.Tensor  # (t,) float64
    values: torch.Tensor  # (t, dv)


def apply(layer: RaggedLayer, entries: list[HeadEntries]) -> None:
    """Keep each head's entries in a layer that holds the whole context in order; write biases and values."""
    layer.keep_only([e.idx for e in entries])
    for h, e in enumerate(entries):
        layer.set_bias(h, e.beta)
        layer.set_values(h, e.values)


def layer_blocks(windows: list[int | None], span: slice, n: int) -> dict[int, slice]:
    """Per layer, the block compacted: the span, or in a sliding layer the part of it its window still shows.

    In a sliding layer (window W), the part of ``span`` among the last W - 1 of the ``n`` positions (what the
    next query sees); a layer whose window shows none of the span has no block.
    """
    blocks = {}
    for i, w in enumerate(windows):
        block = span if w is None else slice(max(span.start, n - (w - 1)), span.stop)
        if block.stop > block.start:
            blocks[i] = block
    return blocks


def assemble(
    prefill: Prefill, index: int, h: int, pieces: list[tuple[slice, am.Compacted]], span: slice
) -> HeadEntries:
    """Head h of layer ``index`` over the whole context: tokens outside ``span`` as they are, then each chunk's."""
    keys, values = prefill.kv(index)
    n = keys.shape[1]
    outside = torch.cat([torch.arange(0, span.start), torch.arange(span.stop, n)])
    idx = [outside] + [chunk.start + c.idx for chunk, c in pieces]
    beta = [torch.zeros(len(outside), dtype=torch.float64)] + [c.beta for _, c in pieces]
    vals = [values[h, outside].double().cpu()] + [c.values for _, c in pieces]
    order = torch.cat(idx).argsort()
    return HeadEntries(torch.cat(idx)[order], torch.cat(beta)[order], torch.cat(vals)[order])


def heldout_summary(errors: dict[tuple[int, int], list[dict[str, float]]]) -> dict[str, object]:
    """Held-out errors per (layer, KV head) (averaged over chunks) and each metric's mean over heads."""
    if not errors:
        return {}
    per = {f"L{i}H{h}": {k: sum(e[k] for e in errs) / len(errs) for k in errs[0]} for (i, h), errs in errors.items()}
    means = {f"heldout_{m}": sum(e[m] for e in per.values()) / len(per) for m in next(iter(per.values()))}
    return {**means, "per_layer_head": per}


def kvzip_scores(session: Session, prompt: Prompt, prefill: Prefill) -> list[torch.Tensor]:
    """Per layer (Hkv, T): KVzip+ oracle scores of every context position (template head: +inf)."""
    context = prompt.context_ids[0, prompt.head_len :].tolist()
    layers = chunked_oracle_scores(session.adapter, session.tokenizer, prefill.cache, context, prompt.head_len)
    inf = torch.full((1, prompt.head_len), float("inf"))
    return [torch.cat([inf.expand(s.kvzip_plus.shape[0], -1), s.kvzip_plus.float()], 1) for s in layers]
