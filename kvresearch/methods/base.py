"""What every method shares: the session it runs in, dense prefill, and cache surgery from scores.

A method is a small dataclass with ``compress(session, prompt) -> RaggedCache`` and, for methods that
also prune while generating, ``decode_context(session, cache)``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvresearch.cache import RaggedCache, ragged_attention_enabled
from kvresearch.generation import Prompt
from kvresearch.models.adapter import ModelAdapter
from kvresearch.models.hooks import attention_inputs
from kvresearch.ops.selection import keep_threshold, keep_topk, protect_window


@dataclass
class Session:
    """A loaded model as methods see it."""

    adapter: ModelAdapter
    tokenizer: Any

    @property
    def model(self) -> Any:
        return self.adapter.model

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self) -> RaggedCache:
        return RaggedCache(self.adapter.num_layers, [layer.sliding_window for layer in self.adapter.layers])


@torch.no_grad()
def dense_prefill(session: Session, ids: torch.Tensor, inputs: dict[int, torch.Tensor] | None = None) -> DynamicCache:
    """Prefill ``ids`` (1, T) into a DynamicCache; optionally record each layer's attention input h."""
    cache = DynamicCache()
    with attention_inputs(session.adapter, inputs) if inputs is not None else nullcontext():
        session.model(input_ids=ids.to(session.device), past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def ragged_prefill(session: Session, ids: torch.Tensor, cache: RaggedCache, chunk_size: int | None = None) -> None:
    """Prefill ``ids`` (1, T) into a ragged cache, in chunks of ``chunk_size`` tokens (None: one pass)."""
    step = chunk_size or ids.shape[1]
    with ragged_attention_enabled(session.model):
        for start in range(0, ids.shape[1], step):
            chunk = ids[:, start : start + step].to(session.device)
            session.model(input_ids=chunk, past_key_values=cache, use_cache=True)


def cache_from_scores(
    dense: DynamicCache,
    scores: list[torch.Tensor],
    threshold: float | None = None,
    keep_ratio: float | None = None,
    scope: str = "head",
    window: int = 0,
    sinks: int = 0,
) -> RaggedCache:
    """Keep entries by threshold or by a keep_ratio budget; the last ``window`` and first ``sinks`` always stay.

    Args:
        scores: per layer (kv_heads, T), higher is more important.
    """
    if (threshold is None) == (keep_ratio is None):
        raise ValueError("give exactly one of threshold and keep_ratio")
    protected = protect_window(scores, window, sinks)
    if threshold is not None:
        keep = keep_threshold(protected, threshold)
    else:
        keep = keep_topk(protected, float(keep_ratio), scope)  # type: ignore[arg-type]
    return RaggedCache.from_dynamic(dense, keep)


class FullCache:
    """No compression: the whole context in the ragged cache (the reference every method is compared to)."""

    name = "full"
    decoding = False

    def __init__(self, chunk_size: int | None = None):
        self.chunk_size = chunk_size

    def compress(self, session: Session, prompt: Prompt) -> RaggedCache:
        cache = session.new_cache()
        ragged_prefill(session, prompt.context_ids, cache, self.chunk_size)
        cache.compact()  # shrink the buffers to the context
        return cache

    def decode_context(self, session: Session, cache: RaggedCache) -> AbstractContextManager[Any]:
        return nullcontext()
