"""Summarization baselines of the Attention Matching paper.

The model summarises the context and the summary replaces it (``summarize``), optionally compacted
further by another method (``summarize_am``).

The summary is generated greedily over the context's own cache, with a budget of ``keep_ratio`` times
the context's tokens (or ``max_new_tokens``); the new context is the template head, the summary and the
template end, prefilled at positions 0.. (questions continue after the summary). The cache reports the
original context length as what it stands for, so its prune ratio is 1 - kept / (original tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvresearch.methods.base import FullCache, Method
from kvresearch.models.cache import RaggedCache
from kvresearch.models.session import Session
from kvresearch.prompts import Prompt

INSTRUCTION = "Summarize the text above. Keep every name, number and fact needed to answer questions about it."


@dataclass(kw_only=True)
class Summarize(Method):
    """Replace the context by the model's summary of it; ``then`` compacts the summary (a method)."""

    name: str = "summarize"
    keep_ratio: float | None = 0.1  # summary budget as a share of the context's tokens; None: max_new_tokens
    max_new_tokens: int = 512
    instruction: str = INSTRUCTION
    then: Method | None = None
    _report: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def compress(self, session: Session, prompt: Prompt) -> RaggedCache:
        """Summarise over the context's cache, then cache the summary (through ``then`` if set)."""
        start = time.perf_counter()
        article = prompt.article.stop - prompt.article.start
        budget = max(1, int(self.keep_ratio * article)) if self.keep_ratio else self.max_new_tokens
        prefill = session.dense_prefill(prompt.context_ids)
        ask = prompt.ask(session.tokenizer, self.instruction if prompt.opener else "\n\n" + self.instruction)
        summary = session.generate(prefill.cache, ask, budget).tokens
        ids = prompt.context_ids
        new_ids = torch.cat([ids[:, : prompt.head_len], torch.tensor([summary]), ids[:, prompt.article.stop :]], dim=1)
        shorter = Prompt(
            new_ids.long(), prompt.question_ids, prompt.head_len, prompt.end_len, prompt.opener, prompt.tail
        )
        summarised = time.perf_counter()
        cache = (self.then or FullCache()).compress(session, shorter)
        cache.stands_for = int(ids.shape[1])
        self._report = {
            "summary_tokens": len(summary),
            "context_tokens": article,
            "summary_ratio": len(summary) / max(article, 1),
            "summary": session.tokenizer.decode(summary, skip_special_tokens=True),
            "timings_s": {"summary_s": summarised - start, "then_s": time.perf_counter() - summarised},
        }
        if self.then is not None:
            self._report["then"] = {k: v for k, v in self.then.report().items() if k != "per_layer_head"}
        return cache

    def report(self) -> dict[str, Any]:
        """The summary, its length against the context's, and the timings."""
        return self._report
