"""KVzip and KVzip+ as pruning methods: the chunked oracle over the prefilled context, then eviction.

Scores come from ``chunked_oracle_scores`` (chunks of ``chunk_size`` tokens; see ``capture.py`` for the
choices). Thresholds are in log space (like KVzap's); the template head is never evicted.
"""

from __future__ import annotations

import hashlib
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from kvresearch.capture import chunked_oracle_scores
from kvresearch.methods.base import Method, cache_from_scores, check_scope
from kvresearch.methods.decoding import recompressing, remember_prompt
from kvresearch.models.cache import RaggedCache
from kvresearch.models.session import Session
from kvresearch.prompts import Prompt


@dataclass(kw_only=True)
class KVzip(Method):
    """The KVzip (``plus=false``) or KVzip+ oracle with a keep_ratio budget or a log-space threshold."""

    name: str = "kvzip_plus"
    plus: bool = True
    threshold: float | None = None
    scope: str = "global"  # for keep_ratio: ops.selection.SCOPES
    reduction: str = "max"  # how the token scopes score a position over its heads: ops.selection.REDUCTIONS
    page_size: int = 1  # with a token scope: keep whole pages of this many positions (vLLM: 16)
    chunk_size: int = 2048
    window: int = 0  # most recent tokens always kept
    decoding_fields = ("interval", "target_size", "protect")  # re-compression while generating (methods/decoding.py)

    def __post_init__(self) -> None:
        """Exactly one budget and a known scope."""
        super().__post_init__()
        self.require_one("threshold")
        check_scope(
            self.name, self.scope, self.reduction, page_size=self.page_size, by_threshold=self.keep_ratio is None
        )

    def budget(self) -> str:
        """``tau=<threshold>`` in threshold mode, else the keep ratio."""
        return f"tau={self.threshold:g}" if self.threshold is not None else super().budget()

    def compress(self, session: Session, prompt: Prompt) -> RaggedCache:
        """Dense prefill, oracle scores by chunked repeat passes, then the budget."""
        ids = prompt.context_ids
        prefill = session.dense_prefill(ids)
        context = ids[0, prompt.head_len :].tolist()

        def oracle() -> dict[str, torch.Tensor]:
            layers = chunked_oracle_scores(
                session.adapter, session.tokenizer, prefill.cache, context, prompt.head_len, chunk_size=self.chunk_size
            )
            return {f"{i}": (layer.kvzip_plus if self.plus else layer.kvzip) for i, layer in enumerate(layers)}

        # The oracle does not depend on the budget: the cells of a sweep over budgets compute it once.
        digest = hashlib.sha1(str(ids[0].tolist()).encode()).hexdigest()
        key = f"kvzip|plus={self.plus}|chunk={self.chunk_size}|head={prompt.head_len}|ids={digest}"
        raw = session.memo.get_or_compute(key, oracle) if session.memo is not None else oracle()
        scores = []
        for i in range(len(raw)):
            s = raw[f"{i}"].clamp_min(1e-30).log()  # (Hkv, C)
            sinks = torch.full((s.shape[0], prompt.head_len), float("inf"))
            scores.append(torch.cat([sinks, s], dim=1))
        cache = cache_from_scores(
            prefill,
            scores,
            self.threshold,
            self.keep_ratio,
            self.scope,
            self.window,
            reduction=self.reduction,
            page_size=self.page_size,
        )
        remember_prompt(cache, prompt)
        return cache

    def decode_context(self, session: Session, cache: RaggedCache) -> AbstractContextManager[Any]:
        """With ``decoding`` set, the cache is re-compressed on its schedule while generating."""
        return recompressing(self, session, cache, self.decoding) if self.decoding else nullcontext()
