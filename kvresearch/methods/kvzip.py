"""KVzip and KVzip+ as pruning methods: the chunked oracle over the prefilled context, then eviction.

Scores come from ``chunked_oracle_scores`` (chunks of ``chunk_size`` tokens; see ``capture.py`` for the
choices). Thresholds are in log space (like KVzap's); the template head is never evicted.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from kvresearch.cache import RaggedCache
from kvresearch.capture import chunked_oracle_scores
from kvresearch.methods.base import Session, cache_from_scores, dense_prefill


class KVzipMethod:
    decoding = False

    def __init__(
        self,
        plus: bool = True,
        threshold: float | None = None,
        keep_ratio: float | None = None,
        scope: str = "global",
        chunk_size: int = 2048,
        window: int = 0,
        name: str = "kvzip_plus",
    ):
        if (threshold is None) == (keep_ratio is None):
            raise ValueError("KVzip needs exactly one of threshold and keep_ratio")
        self.plus, self.threshold, self.keep_ratio, self.scope = plus, threshold, keep_ratio, scope
        self.chunk_size, self.window, self.name = chunk_size, window, name

    def compress(self, session: Session, prompt: Any) -> RaggedCache:
        ids = prompt.context_ids
        dense = dense_prefill(session, ids)
        context = ids[0, prompt.head_len :].tolist()
        layers = chunked_oracle_scores(
            session.adapter, session.tokenizer, dense, context, prompt.head_len, chunk_size=self.chunk_size
        )
        scores = []
        for layer in layers:
            s = (layer.kvzip_plus if self.plus else layer.kvzip).clamp_min(1e-30).log()  # (Hkv, C)
            sinks = torch.full((s.shape[0], prompt.head_len), float("inf"))
            scores.append(torch.cat([sinks, s], dim=1))
        return cache_from_scores(dense, scores, self.threshold, self.keep_ratio, self.scope, self.window)

    def decode_context(self, session: Session, cache: RaggedCache) -> Any:
        return nullcontext()
