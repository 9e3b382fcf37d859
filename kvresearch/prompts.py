"""Prompt layout: the one place that splits a chat template around a context.

Two layouts, both built from ids of separately tokenised pieces so that spans are exact:

* question prompt (evaluation, kvpress's pipeline): ``head | context`` is what a method may compress;
  ``question + end of user turn + assistant header + answer prefix`` is fed after it;
* repeat prompt (KVzip's oracle, Attention Matching's repeat-prefill queries):
  ``head | context | instruction + middle | context``, the second copy teacher-forced as the answer.

The repeat instructions follow their references: KVzap's training code and KVzip ask to repeat
"exactly" (:data:`KVZIP_REPEAT`; later chunks :data:`KVZIP_CONTINUE` + the last tokens of the previous
chunk), the Attention Matching code asks to repeat "verbatim" (:data:`AM_REPEAT`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

KVZIP_REPEAT = "\n\nRepeat the previous context exactly."
KVZIP_CONTINUE = "\n\nRepeat the part of the previous context exactly, starting with"
AM_REPEAT = "\n\nRepeat the previous context verbatim."
_MARK = "\x00KVR_SPLIT\x00"


def _split_chat(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[str]:
    """The rendered chat template cut at the marks placed in the messages' contents."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return rendered.split(_MARK)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


@dataclass
class Prompt:
    """A context to compress and the question that follows it, as ids."""

    context_ids: torch.Tensor  # (1, context_len): template head, then the context itself
    question_ids: torch.Tensor  # (1, question_len)
    head_len: int = 0  # template tokens before the context (system prompt, user header)

    @property
    def n_tokens(self) -> int:
        """Context and question tokens together."""
        return int(self.context_ids.shape[1] + self.question_ids.shape[1])


def build_prompt(tokenizer: Any, context: str, question: str, answer_prefix: str = "") -> Prompt:
    """Chat-template ``context`` + ``question``; return the context part and the question part as ids."""
    if getattr(tokenizer, "chat_template", None):
        head, _, tail = _split_chat(tokenizer, [{"role": "user", "content": _MARK + context + _MARK}], True)
    else:
        head, tail = "", "\n"
    head_ids = _encode(tokenizer, head)  # tokenised apart from the context, as in the repeat prompt
    context_ids = torch.tensor([head_ids + _encode(tokenizer, context)])
    question_ids = torch.tensor([_encode(tokenizer, question + tail + answer_prefix)])
    return Prompt(context_ids, question_ids, len(head_ids))


@dataclass
class TemplatePieces:
    """Token ids of the chat template around the context: head + context + middle, then the repeat."""

    head: list[int]  # before the user content (system prompt, user header)
    middle: list[int]  # between the user content and the assistant content (end of turn, assistant header)


def template_pieces(tokenizer: Any) -> TemplatePieces:
    """The template ids around a user turn followed by an assistant turn."""
    if not getattr(tokenizer, "chat_template", None):
        return TemplatePieces([], _encode(tokenizer, "\n"))
    turns = [{"role": "user", "content": _MARK}, {"role": "assistant", "content": _MARK}]
    head, middle, _tail = _split_chat(tokenizer, turns, False)
    return TemplatePieces(_encode(tokenizer, head), _encode(tokenizer, middle))


@dataclass
class RepeatPrompt:
    """The repeat prompt's ids and the spans of its two context copies."""

    input_ids: torch.Tensor  # (1, L)
    context: slice  # the original context span
    repeat: slice  # the repeated copy (the scoring rows)


def repeat_prompt(
    tokenizer: Any,
    context_ids: list[int],
    pieces: TemplatePieces | None = None,
    instruction_text: str = KVZIP_REPEAT,
) -> RepeatPrompt:
    """``head | context | instruction + middle | context`` with the two context spans marked."""
    pieces = pieces or template_pieces(tokenizer)
    instruction = _encode(tokenizer, instruction_text)
    ids = pieces.head + context_ids + instruction + pieces.middle + context_ids
    start, n = len(pieces.head), len(context_ids)
    return RepeatPrompt(torch.tensor([ids]), slice(start, start + n), slice(len(ids) - n, len(ids)))
