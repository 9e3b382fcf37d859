"""kvpress presses with real eviction (model glue: kvpress's cache and module conventions live here).

A press runs during a dense prefill exactly as in kvpress. Its result then moves into the ragged
cache: presses that drop pairs (ScorerPress family: SnapKV, StreamingLLM, TOVA, Knorm,
ExpectedAttention, PyramidKV, ObservedAttention) leave fewer keys per layer, whose positions we recover
by matching them to the keys captured before the press ran; presses that only mask pairs (DMSPress,
KVzipPress, AdaKV-style) leave ``module.masked_key_indices``, whose pairs we drop. Either way the memory
kvpress keeps is freed.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from kvresearch.models.cache import RaggedCache
from kvresearch.models.hooks import attention_calls
from kvresearch.models.session import Session


def _positions_of(kept: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Indices into ``original`` (T, d) of the rows of ``kept`` (n, d), which are copies of some of them."""
    return torch.cdist(kept.float(), original.float()).argmin(dim=1)  # (n,), in the order of ``kept``


@torch.no_grad()
def press_prefill(
    session: Session, ids: torch.Tensor, press: Any, attn_implementation: str | None = None
) -> RaggedCache:
    """Prefill ``ids`` (1, T) with ``press`` applied (kvpress's own code) and return what it kept, ragged.

    Args:
        session: the model.
        ids: (1, T) the context.
        press: a kvpress press.
        attn_implementation: run the prefill with this attention (e.g. "eager" for presses that read the
            attention weights); the model's own is restored afterwards.
    """
    model = session.model
    ids = ids.to(session.device)
    originals: dict[int, torch.Tensor] = {}
    record = lambda layer, q, k, v: originals.__setitem__(layer, k[0].detach().clone())  # (Hkv, T, d)
    dense = DynamicCache()
    previous = model.config._attn_implementation
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    try:
        with attention_calls(session.adapter, record), press(model):
            model(input_ids=ids, past_key_values=dense, use_cache=True)
    finally:
        model.set_attn_implementation(previous)
    n = ids.shape[1]
    keep: list[list[torch.Tensor]] = []
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for index, spec in enumerate(session.adapter.layers):
        entry = dense.layers[index]
        assert entry.keys is not None and entry.values is not None
        keys, values = entry.keys[0], entry.values[0]  # (Hkv, n or n_kept, d)
        if keys.shape[1] == n:
            mask = torch.ones(keys.shape[0], n, dtype=torch.bool)
            masked = getattr(spec.attn, "masked_key_indices", None)
            if masked is not None:
                _, heads, positions = masked
                mask[heads.cpu(), positions.cpu()] = False
                spec.attn.masked_key_indices = None
            keep.append([torch.nonzero(row).view(-1) for row in mask])
            layers.append((keys, values))
            continue
        # Pairs were dropped: put each kept pair back at its position, then keep only those.
        full_values = values.new_zeros(keys.shape[0], n, values.shape[2])
        kept_layer = []
        for h in range(keys.shape[0]):
            rows = _positions_of(keys[h], originals[index][h])
            full_values[h, rows] = values[h]
            kept_layer.append(rows.sort().values)
        keep.append(kept_layer)
        layers.append((originals[index], full_values))
    return RaggedCache.from_layers(layers, keep, session.windows)


@torch.no_grad()
def masked_pairs(session: Session, ids: torch.Tensor, press: Any) -> tuple[set[tuple[int, int, int]], int]:
    """(layer, KV head, position) pairs a masking press evicts in a plain kvpress prefill, and the bytes kvpress keeps.

    For side-by-side comparisons with kvpress itself (its ``DMSPress`` keeps every pair in memory).
    """
    dense = DynamicCache()
    with press(session.model):
        session.model(input_ids=ids.to(session.device), past_key_values=dense, use_cache=True)
    evicted: set[tuple[int, int, int]] = set()
    for index, spec in enumerate(session.adapter.layers):
        if getattr(spec.attn, "masked_key_indices", None) is not None:
            _, heads, positions = (t.tolist() for t in spec.attn.masked_key_indices)
            evicted |= {(index, h, p) for h, p in zip(heads, positions, strict=True)}
            spec.attn.masked_key_indices = None
    kept_bytes = sum(e.keys.numel() * e.keys.element_size() * 2 for e in dense.layers if e.keys is not None)
    return evicted, kept_bytes
