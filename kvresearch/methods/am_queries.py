"""Reference queries for Attention Matching (model glue).

*Continuation* sources are token sequences that follow the prefilled context; their queries come from
one forward pass of all of them, concatenated into a *suffix*, over a copy of the context's cache (the
context is never prefilled twice):

* ``repeat``: the question "Repeat the previous context verbatim." laid out like the real question,
  then the context itself teacher-forced;
* ``self_study``: the model's own sampled answers to fixed prompts about the context (summarize; list
  the key facts; restructure as JSON; write three questions and answer them), each generated over a copy
  of the context's cache with a seed and a token budget; the prompt and answer tokens.

The answers are generated over the full context; in the suffix they follow the other continuations, so
their queries also see those (a small shift, the price of one pass). ``push_suffix`` calls back, before
each attention layer runs, with that layer's suffix queries: off-policy we only collect them, on-policy
the callback compacts the layer right there (see ``attention_matching.py``).

Other sources: ``context`` (the queries of the context tokens, captured during its prefill) and
``random`` (Gaussian, with the per-dimension scale of the context queries).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from kvresearch.generation import Sampling
from kvresearch.models.cache import RaggedCache
from kvresearch.models.hooks import before_attention
from kvresearch.models.ragged_attention import ragged_attention_enabled
from kvresearch.models.session import Prefill, Session
from kvresearch.prompts import AM_REPEAT, Prompt

CONTINUATIONS = ("repeat", "self_study")
SOURCES = (*CONTINUATIONS, "context", "random")

SELF_STUDY_PROMPTS = (
    "Summarize the text above.",
    "Gather the key facts of the text above in one list: names, numbers, dates, places and events.",
    "Rewrite the content of the text above as a JSON object with meaningful keys.",
    "Write three questions about the text above, then answer each of them.",
)


@dataclass
class SelfStudy:
    """The self-study prompts and how their answers are sampled (the reference's non-thinking settings)."""

    prompts: Sequence[str] = SELF_STUDY_PROMPTS
    max_new_tokens: int = 128  # per prompt
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20

    def sampling(self, seed: int) -> Sampling:
        """The sampling settings with ``seed``."""
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed)


def _question(prompt: Prompt, text: str) -> str:
    """``text`` as a follow-up question: its own turn, or a new paragraph of the context's turn."""
    return text if prompt.opener else "\n\n" + text


def repeat_continuation(session: Session, prompt: Prompt, span: slice) -> torch.Tensor:
    """(1, S): the repeat question, then the context tokens of ``span`` teacher-forced."""
    ask = prompt.ask(session.tokenizer, _question(prompt, AM_REPEAT.strip()))
    return torch.cat([ask, prompt.context_ids[:, span]], dim=1)


def self_study_continuations(
    session: Session, prompt: Prompt, cache: object, study: SelfStudy, seed: int
) -> list[torch.Tensor]:
    """(1, S_i) per prompt: the prompt and the model's sampled answer, generated over a copy of ``cache``."""
    out = []
    for i, text in enumerate(study.prompts):
        ask = prompt.ask(session.tokenizer, _question(prompt, text))
        answer = session.generate(cache, ask, study.max_new_tokens, study.sampling(seed), sample=i).tokens
        out.append(torch.cat([ask, torch.tensor([answer], dtype=torch.long)], dim=1))
    return out


QueryCallback = Callable[[int, torch.Tensor], None]  # (layer, q (q_heads, S, d) float64 on the CPU)


@torch.no_grad()
def push_suffix(session: Session, cache: object, suffix: torch.Tensor, callback: QueryCallback) -> None:
    """Feed ``suffix`` (1, S) after ``cache`` (extended in place) once, calling back with each layer's queries.

    The callback runs before the layer's attention, when the layer's cache holds only the context: it may
    rewrite it (on-policy compaction), and the suffix then attends to what it left.
    """
    adapter = session.adapter
    start = int(cache.get_seq_length())  # type: ignore[attr-defined]
    positions = torch.arange(start, start + suffix.shape[1], device=session.device)[None]

    def queries(layer: int, h: torch.Tensor) -> None:
        q, _, _ = adapter.qkv(layer, h, positions)
        callback(layer, q[0].to(torch.float64).cpu())

    ragged = isinstance(cache, RaggedCache)
    with ragged_attention_enabled(session.model) if ragged else nullcontext(), before_attention(adapter, queries):
        session.model(input_ids=suffix.to(session.device), past_key_values=cache, use_cache=True, logits_to_keep=1)


@torch.no_grad()
def prefill_with_queries(session: Session, ids: torch.Tensor, keep: bool) -> tuple[Prefill, list[torch.Tensor]]:
    """Dense prefill of ``ids`` (1, T); with ``keep``, each layer's context queries (q_heads, T, d) too."""
    store: list[torch.Tensor] = []
    positions = torch.arange(ids.shape[1], device=session.device)[None]

    def record(layer: int, h: torch.Tensor) -> None:
        store.append(session.adapter.qkv(layer, h, positions)[0][0].to(torch.float64).cpu())

    with before_attention(session.adapter, record) if keep else nullcontext():
        prefill = session.dense_prefill(ids)
    return prefill, store


def random_like(context: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Gaussian queries with the shape and per-dimension scale of each layer's context queries."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(q.shape, generator=g, dtype=torch.float64) * q.std(dim=(0, 1), keepdim=True) for q in context]


def fixed_queries(context: list[torch.Tensor], sources: Sequence[str], seed: int) -> list[torch.Tensor] | None:
    """Per layer, the queries of the ``context`` and ``random`` sources among ``sources`` (None if neither)."""
    parts = ([context] if "context" in sources else []) + ([random_like(context, seed)] if "random" in sources else [])
    if not parts:
        return None
    return [torch.cat([p[i] for p in parts], dim=1) for i in range(len(parts[0]))]


def pooled(q: torch.Tensor, kv_head: int, group: int, cap: int, seed: int) -> torch.Tensor:
    """Queries of KV head ``kv_head``'s group pooled into (n, d), capped by a seeded subsample."""
    x = q[kv_head * group : (kv_head + 1) * group].reshape(-1, q.shape[-1])
    if x.shape[0] > cap:
        x = x[torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:cap]]
    return x
