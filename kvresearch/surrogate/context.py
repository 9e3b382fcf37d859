"""Context inputs of a surrogate: what the attention input h_i does not carry, computed alike in training and inference.

A KVzap surrogate reads h_i alone. ``surrogate.context`` appends columns that the surrogate study found to carry
more of the KVzip+ score on a source left out of training (docs/surrogates.md), in this order:

* ``value_norms``: log ||v_i W_O^g|| for every query head g (q_heads columns), the score's second factor, from
  h_i and the layer's own weights;
* ``position``: log(1 + i), i the token's offset in its context;
* ``counts``: :data:`COUNTS` as log(1 + rate per 1,000 context tokens), length-free so that a surrogate trained
  on 1k-token documents reads a 4k context on the same scale;
* ``length``: log(1 + n), n the context's length (the KVzip+ score of a key falls as more keys share the
  attention, so the length shifts every score of a context).

Training computes them from the extract's rows and its rebuilt documents, inference (``KVzap``) from the
prefill's h, positions and token ids: one function, :func:`context_features`, forms them in both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from kvresearch.errors import KVResearchError
from kvresearch.models.adapter import ModelAdapter
from kvresearch.ops.scores import value_output_norms

CONTEXT_INPUTS = ("value_norms", "position", "counts", "length")
COUNTS = ("token", "previous token", "bigram", "token before", "bigram before")
RATE_PER = 1000.0  # counts are rates per this many context tokens


def canonical(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` in :data:`CONTEXT_INPUTS` order, each once; an unknown name is refused with the choices."""
    unknown = sorted(set(names) - set(CONTEXT_INPUTS))
    if unknown:
        raise KVResearchError(
            f"surrogate.context: unknown input(s) {unknown}; choose from {list(CONTEXT_INPUTS)} (or [] for h alone)."
        )
    return tuple(name for name in CONTEXT_INPUTS if name in names)


def context_width(names: Sequence[str], q_heads: int) -> int:
    """Columns that ``names`` append to h."""
    widths = {"value_norms": q_heads, "position": 1, "counts": len(COUNTS), "length": 1}
    return sum(widths[name] for name in canonical(names))


def occurrences(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per element of ``keys`` (n,): how often its value occurs in all of ``keys``, and before it."""
    _, inverse, totals = np.unique(keys, return_inverse=True, return_counts=True)
    order = np.argsort(inverse, kind="stable")  # equal keys together, in their original order
    first = np.r_[0, np.cumsum(totals)[:-1]]  # where each key's run starts in ``order``
    before = np.empty(len(keys), np.int64)
    before[order] = np.arange(len(keys)) - first[inverse[order]]
    return totals[inverse], before


def raw_counts(ids: np.ndarray) -> np.ndarray:
    """(n, 5) int64: each :data:`COUNTS` entry at every position of one context's ids (n,).

    The previous token and the bigram of position 0 do not exist: their counts are 0.
    """
    ids = np.asarray(ids, dtype=np.int64)
    out = np.zeros((len(ids), len(COUNTS)), np.int64)
    if len(ids) == 0:
        return out
    bigram = ids[:-1] * (int(ids.max()) + 1) + ids[1:]  # bigram[p - 1] ends at position p
    out[:, 0], out[:, 3] = occurrences(ids)
    out[1:, 1] = out[:-1, 0]
    out[1:, 2], out[1:, 4] = occurrences(bigram)
    return out


def count_rates(ids: np.ndarray) -> torch.Tensor:
    """(n, 5) float32: :func:`raw_counts` as log(1 + count x 1000 / n), n the context's length."""
    n = max(len(ids), 1)
    return torch.from_numpy(np.log1p(raw_counts(ids) * (RATE_PER / n)).astype(np.float32))


def context_features(
    names: Sequence[str],
    adapter: ModelAdapter,
    layer: int,
    h: torch.Tensor,
    positions: torch.Tensor,
    rates: torch.Tensor | None,
    length: int,
) -> torch.Tensor:
    """(T, width) context columns of T tokens at one layer, in :data:`CONTEXT_INPUTS` order.

    Args:
        names: the surrogate's ``context``.
        adapter: the model, for the value and output projections of ``layer``.
        layer: decoder layer index.
        h: (T, hidden) the tokens' attention inputs at ``layer``.
        positions: (T,) the tokens' offsets in their context.
        rates: (T, 5) :func:`count_rates` rows of the tokens (needed for ``counts``).
        length: the context's length (its tokens so far while decoding).
    """
    columns = []
    for name in canonical(names):
        if name == "value_norms":
            with torch.no_grad():
                _, _, v = adapter.project(layer, h.float()[None])  # (1, Hkv, T, d)
                norms = value_output_norms(v[0], adapter.output_weight(layer).float())  # (Hkv, G, T)
            columns.append(norms.flatten(0, 1).T.clamp_min(1e-12).log())
        elif name == "position":
            columns.append(torch.log1p(positions.float())[:, None].to(h.device))
        elif name == "length":
            columns.append(torch.full((len(h), 1), math.log1p(length), device=h.device))
        else:
            if rates is None:
                raise KVResearchError("surrogate.context has 'counts' but no token ids were given for the context.")
            columns.append(rates.float().to(h.device))
    return torch.cat(columns, 1) if columns else h.new_zeros(len(h), 0).float()


def with_context(
    names: Sequence[str],
    adapter: ModelAdapter,
    layer: int,
    h: torch.Tensor,
    positions: torch.Tensor,
    rates: torch.Tensor | None,
    length: int,
) -> torch.Tensor:
    """What a surrogate of context ``names`` reads: h (T, hidden), then :func:`context_features` (h alone for ())."""
    if not names:
        return h
    return torch.cat([h.float(), context_features(names, adapter, layer, h, positions, rates, length)], -1)
