"""Compression while decoding for methods that compress a whole context (KVzip+, Attention Matching).

``DecodingBudget`` (``methods/base.py``, the one type of every method's ``decoding`` option): every
``interval`` decoding steps, a cache whose largest KV head holds more than ``target_size`` entries is
re-compressed back to ``target_size`` entries per head (kvpress's ``DecodingPress`` contract: between
compressions the cache holds at most ``target_size + interval - 1``).

Re-compression follows the Attention Matching code's reasoning experiment: everything but the last
``protect`` tokens is compressed by the method, the protected tokens stay as they are. The method
compresses the token prefix (context, question and the tokens generated so far) from its ids, at the
keep ratio that brings it to ``target_size - protect`` entries per head, so a re-compression equals
compressing the same prefix once. The prefix is prefilled densely for that (the reference does the same
at its first compaction); later compactions in the reference compact the already compacted cache, ours
start again from the ids. KVzap prunes while decoding by its own rule (``methods/kvzap.py``) and kvpress
presses through kvpress's ``DecodingPress`` (``models/presses.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvresearch.errors import KVResearchError
from kvresearch.methods.base import DecodingBudget, Method
from kvresearch.models.cache import RaggedCache
from kvresearch.models.hooks import model_calls
from kvresearch.models.session import Session
from kvresearch.prompts import Prompt


def remember_prompt(cache: RaggedCache, prompt: Prompt) -> None:
    """Keep the compressed context's ids on the cache, for a later re-compression of the whole prefix."""
    cache.method_state["history"] = prompt.context_ids[0].tolist()
    cache.method_state["head_len"] = prompt.head_len


def _largest_head(cache: RaggedCache) -> int:
    return max(int(layer.stored_per_head().max()) for layer in cache.ragged if layer.is_initialized)


@torch.no_grad()
def recompress(method: Method, session: Session, cache: RaggedCache, budget: DecodingBudget) -> dict[str, Any]:
    """Re-compress ``cache`` in place: the prefix but the last ``protect`` tokens by ``method``, at its budget."""
    history: list[int] = cache.method_state["history"]
    seen = cache.get_seq_length()
    if len(history) != seen:
        raise KVResearchError(f"re-compression: {len(history)} token ids recorded for {seen} positions.")
    assert budget.protect is not None and budget.target_size is not None  # read by every re-compressing method
    cut = seen - budget.protect
    kept = cache.method_state["head_len"] if getattr(method, "keeps_template", False) else 0  # AM on the article span
    ratio = min(1.0, max(budget.target_size - budget.protect - kept, 1) / max(cut - kept, 1))
    prefix = Prompt(torch.tensor([history[:cut]]), torch.zeros(1, 0, dtype=torch.long), cache.method_state["head_len"])
    changes: dict[str, Any] = {"keep_ratio": ratio, "decoding": None}
    if hasattr(method, "threshold"):
        changes["threshold"] = None  # the budget, not a threshold, sets what is kept
    cache.splice(dataclasses.replace(method, **changes).compress(session, prefix), cut)  # protected tail kept
    event = {"position": seen, "prefix": cut, "keep_ratio": ratio}
    cache.method_state.setdefault("recompressions", []).append(event)
    return event


@contextmanager
def recompressing(method: Method, session: Session, cache: RaggedCache, budget: DecodingBudget) -> Iterator[None]:
    """Within the block, record the ids fed to the model and re-compress on ``budget``'s schedule."""
    if "history" not in cache.method_state:
        raise KVResearchError(
            f"method {method.name}: this cache was not made by the method's compress(), so its token ids are "
            "unknown and it cannot be re-compressed while decoding."
        )
    history: list[int] = cache.method_state["history"]
    state = {"steps": 0, "busy": False}

    def before(ids: torch.Tensor) -> None:
        if not state["busy"]:
            history.extend(ids[0].tolist())

    def after(ids: torch.Tensor) -> None:
        if state["busy"] or ids.shape[1] != 1:  # the question, fed in one call, is not a decoding step
            return
        state["steps"] += 1
        if state["steps"] >= (budget.interval or 1):
            state["steps"] = 0
            if _largest_head(cache) > (budget.target_size or 0):
                state["busy"] = True
                try:
                    recompress(method, session, cache, budget)
                finally:
                    state["busy"] = False

    with model_calls(session.model, before, after):
        yield
