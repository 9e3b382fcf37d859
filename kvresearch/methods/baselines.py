"""kvpress presses behind our interface, with real eviction.

The press runs during a dense prefill exactly as in kvpress. Then its result moves into the ragged
cache: presses that drop pairs (ScorerPress family: SnapKV, StreamingLLM, TOVA, Knorm, ExpectedAttention,
PyramidKV, ObservedAttention) leave fewer keys per layer, whose positions we recover by matching them to
the keys captured before the press ran; presses that only mask pairs (DMSPress, KVzipPress, AdaKV-style)
leave ``module.masked_key_indices``, whose pairs we drop. Either way the memory kvpress keeps is freed.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from transformers import DynamicCache

from kvresearch.cache import RaggedCache
from kvresearch.methods.base import Session
from kvresearch.models.hooks import attention_calls


def _positions_of(kept: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Indices into ``original`` (T, d) of the rows of ``kept`` (n, d), which are copies of some of them."""
    return torch.cdist(kept.float(), original.float()).argmin(dim=1)  # (n,), in the order of ``kept``


class KVPressMethod:
    """Any kvpress press (built by Hydra from its config) as a pruning method."""

    decoding = False

    def __init__(self, press: Any, name: str = "kvpress", attn_implementation: str | None = None):
        self.press, self.name = press, name
        self.attn_implementation = attn_implementation  # e.g. "eager" for presses that read attention weights

    @torch.no_grad()
    def compress(self, session: Session, prompt: Any) -> RaggedCache:
        ids = prompt.context_ids.to(session.device)
        originals: dict[int, torch.Tensor] = {}
        record = lambda layer, q, k, v: originals.__setitem__(layer, k[0].detach().clone())  # (Hkv, T, d)
        dense = DynamicCache()
        previous = session.model.config._attn_implementation
        if self.attn_implementation:
            session.model.set_attn_implementation(self.attn_implementation)
        try:
            with attention_calls(session.adapter, record), self.press(session.model):
                session.model(input_ids=ids, past_key_values=dense, use_cache=True)
        finally:
            session.model.set_attn_implementation(previous)
        n = ids.shape[1]
        keep: list[list[torch.Tensor]] = []
        full = DynamicCache()
        for index, spec in enumerate(session.adapter.layers):
            layer = dense.layers[index]
            assert layer.keys is not None and layer.values is not None
            keys, values = layer.keys[0], layer.values[0]  # (Hkv, n or n_kept, d)
            if keys.shape[1] == n:
                mask = torch.ones(keys.shape[0], n, dtype=torch.bool)
                masked = getattr(spec.attn, "masked_key_indices", None)
                if masked is not None:
                    _, heads, positions = masked
                    mask[heads.cpu(), positions.cpu()] = False
                    spec.attn.masked_key_indices = None
                keep.append([torch.nonzero(row).view(-1) for row in mask])
                full.update(keys[None], values[None], index)
                continue
            # Pairs were dropped: put each kept pair back at its position, then keep only those.
            full_values = values.new_zeros(keys.shape[0], n, values.shape[2])
            kept_layer = []
            for h in range(keys.shape[0]):
                rows = _positions_of(keys[h], originals[index][h])
                full_values[h, rows] = values[h]
                kept_layer.append(rows.sort().values)
            keep.append(kept_layer)
            full.update(originals[index][None], full_values[None], index)
        return RaggedCache.from_dynamic(full, keep)

    def decode_context(self, session: Session, cache: RaggedCache) -> Any:
        return nullcontext()


def kvpress_kvzap(
    surrogate_path: str, model_type: str, threshold: float, window: int = 128, decoding: bool = False
) -> Any:
    """kvpress's own ``DMSPress(KVzapPress)`` with its surrogate loaded from our export (kvpress layout)."""
    from dataclasses import dataclass as _dataclass

    from kvpress import DMSPress, KVzapPress
    from kvpress.presses.kvzap_press import KVzapModel

    @_dataclass
    class LocalKVzapPress(KVzapPress):
        path: str = ""

        def post_init_from_model(self, model: Any) -> None:
            if getattr(self, "kvzap_model", None) is None:
                self.kvzap_model = KVzapModel.from_pretrained(self.path)

    return DMSPress(
        LocalKVzapPress(model_type=model_type, path=surrogate_path),
        threshold=threshold,
        sliding_window_size=window,
        decoding=decoding,
    )
