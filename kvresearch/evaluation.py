"""One sample through one method: compress the context once, answer from a copy of the cache.

Also the fidelity metric of the Attention Matching paper: the log-perplexity of a reference answer
(the full-cache model's own) under a compressed cache.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from kvresearch.cache import RaggedCache, ragged_attention_enabled
from kvresearch.generation import Prompt, eos_ids, greedy
from kvresearch.methods.base import Session


def compress(method: Any, session: Session, prompt: Prompt) -> tuple[RaggedCache, float]:
    start = time.perf_counter()
    cache = method.compress(session, prompt)
    return cache, time.perf_counter() - start


@torch.no_grad()
def answer(
    method: Any,
    session: Session,
    cache: RaggedCache,
    question_ids: torch.Tensor,
    max_new_tokens: int,
    stop: bool = True,
) -> tuple[list[int], float]:
    """Greedy answer after ``cache`` (left untouched: a copy is extended); ``stop=False`` ignores EOS."""
    working = copy.deepcopy(cache)
    eos = eos_ids(session.model, session.tokenizer) if stop else set()
    start = time.perf_counter()
    with ragged_attention_enabled(session.model), method.decode_context(session, working):
        tokens = greedy(session.model, working, question_ids, max_new_tokens, eos)
    return tokens, time.perf_counter() - start


@torch.no_grad()
def answer_logprob(session: Session, cache: RaggedCache, question_ids: torch.Tensor, answer_ids: list[int]) -> float:
    """Mean negative log-likelihood per token of ``answer_ids`` after the question, under ``cache``."""
    if not answer_ids:
        return float("nan")
    working = copy.deepcopy(cache)
    ids = torch.cat([question_ids, torch.tensor([answer_ids])], dim=1).to(session.device)
    with ragged_attention_enabled(session.model):
        logits = session.model(input_ids=ids, past_key_values=working, use_cache=True).logits[0]
    n_q = question_ids.shape[1]
    logprobs = torch.log_softmax(logits[n_q - 1 : -1].float(), dim=-1)
    target = torch.tensor(answer_ids, device=logprobs.device)
    return float(-logprobs.gather(1, target[:, None]).mean())
