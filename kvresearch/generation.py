"""Prompt layout and greedy decoding over an explicit cache (model glue).

A sample is split like kvpress's pipeline does: the chat-templated context (the part a method may
compress) and the question part (question, end of the user turn, assistant start, answer prefix),
which is fed after compression and is not compressed unless a method asks for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

_SPLIT = "\x00KVR_SPLIT\x00"


@dataclass
class Prompt:
    context_ids: torch.Tensor  # (1, context_len): template head, then the context itself
    question_ids: torch.Tensor  # (1, question_len)
    head_len: int = 0  # template tokens before the context (system prompt, user header)


def build_prompt(tokenizer: Any, context: str, question: str, answer_prefix: str = "") -> Prompt:
    """Chat-template ``context`` + ``question``; return the context part and the question part as ids."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SPLIT + context + _SPLIT}], add_generation_prompt=True, tokenize=False
        )
        head, _, tail = rendered.split(_SPLIT)
    else:
        head, tail = "", "\n"
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    head_ids = encode(head)  # tokenised apart from the context, as in the repeat prompt of capture.py
    context_ids = torch.tensor([head_ids + encode(context)])
    question_ids = torch.tensor([encode(question + tail + answer_prefix)])
    return Prompt(context_ids, question_ids, len(head_ids))


@dataclass
class Generation:
    token_ids: list[int]
    prefill_s: float
    decode_s: float
    context_len: int

    @property
    def decode_tokens_per_s(self) -> float:
        return len(self.token_ids) / self.decode_s if self.decode_s > 0 else float("nan")


@torch.no_grad()
def prefill(model: PreTrainedModel, input_ids: torch.Tensor, cache: Any = None) -> Any:
    """Run ``input_ids`` (1, T) through the model into ``cache`` (a new DynamicCache by default)."""
    cache = DynamicCache() if cache is None else cache
    model(input_ids=input_ids.to(model.device), past_key_values=cache, use_cache=True)
    return cache


@torch.no_grad()
def greedy(
    model: PreTrainedModel, cache: Any, input_ids: torch.Tensor, max_new_tokens: int, eos_ids: set[int]
) -> list[int]:
    """Feed ``input_ids`` (1, Q) after ``cache`` and decode greedily; stops at an EOS id (not returned)."""
    out: list[int] = []
    logits = model(input_ids=input_ids.to(model.device), past_key_values=cache, use_cache=True).logits
    for _ in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        if token in eos_ids:
            break
        out.append(token)
        step = torch.tensor([[token]], device=model.device)
        logits = model(input_ids=step, past_key_values=cache, use_cache=True).logits
    return out


def eos_ids(model: PreTrainedModel, tokenizer: Any) -> set[int]:
    ids = model.generation_config.eos_token_id
    found = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        found.add(int(tokenizer.eos_token_id))
    return found


def answer(model: PreTrainedModel, tokenizer: Any, prompt: Prompt, max_new_tokens: int) -> Generation:
    """Full-cache greedy answer with prefill and decode timed separately."""
    start = time.perf_counter()
    cache = prefill(model, prompt.context_ids)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    tokens = greedy(model, cache, prompt.question_ids, max_new_tokens, eos_ids(model, tokenizer))
    return Generation(tokens, prefill_s, time.perf_counter() - start, prompt.context_ids.shape[1])
