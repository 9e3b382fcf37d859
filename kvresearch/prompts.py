"""Prompt layout: the one place that splits a chat template around a context.

Layouts, all built from ids of separately tokenised pieces so that spans are exact:

* question prompt, ``one_turn`` (evaluation, kvpress's pipeline): ``head | context`` is what a method may
  compress; ``question + end of user turn + assistant header + answer prefix`` is fed after it;
  ``two_turns`` (the Attention Matching code's layout): the context is a whole first user turn
  (``head | context | end of turn``), the question a second user turn; ``plain``: no chat template
  (LongBench's rule for its few-shot and code tasks); any of them with an optional system prompt;
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
    end_len: int = 0  # template tokens after the context (the end of its turn, in the two-turn layout)
    opener: str = ""  # text that opens a question after the context (the next user turn's header) ...
    tail: str = ""  # ... and closes it (the assistant header)

    @property
    def article(self) -> slice:
        """The context's own tokens within ``context_ids``: what compaction may touch."""
        return slice(self.head_len, int(self.context_ids.shape[1]) - self.end_len)

    def ask(self, tokenizer: Any, text: str) -> torch.Tensor:
        """(1, Q) ids of ``text`` laid out as a question after this context, as the real question is."""
        return torch.tensor([_encode(tokenizer, self.opener + text + self.tail)])

    @property
    def n_tokens(self) -> int:
        """Context and question tokens together."""
        return int(self.context_ids.shape[1] + self.question_ids.shape[1])


@dataclass
class _Layout:
    """The text around a context and a question: ``head + context + end``, then ``opener + question + tail``."""

    head: str = ""
    end: str = ""
    opener: str = ""
    tail: str = ""


def _layout(tokenizer: Any, layout: str, system: str | None, context: str, question: str) -> _Layout:
    if layout == "plain":  # raw text, with the start token the tokenizer adds by default (LongBench's tokenizer call)
        ids = tokenizer("x").input_ids
        bos = getattr(tokenizer, "bos_token", None)
        return _Layout(head=bos if bos and ids and ids[0] == tokenizer.bos_token_id else "")
    if not getattr(tokenizer, "chat_template", None):  # a base model: its start token, then plain text
        return _Layout(head=getattr(tokenizer, "bos_token", None) or "", tail="\n")
    before = [{"role": "system", "content": system}] if system else []
    marked = [*before, {"role": "user", "content": _MARK + context + _MARK}]
    if layout == "one_turn":
        head, _, tail = _split_chat(tokenizer, marked, True)
        return _Layout(head=head, tail=tail)
    head, _, end = _split_chat(tokenizer, marked, False)
    turns = [*before, {"role": "user", "content": context}, {"role": "user", "content": _MARK + question + _MARK}]
    full, _, tail = _split_chat(tokenizer, turns, True)
    first = head + context + end
    if not full.startswith(first):
        raise ValueError("this chat template does not render the first turn as a prefix of the two turns")
    return _Layout(head, end, full[len(first) :], tail)


def build_prompt(
    tokenizer: Any,
    context: str,
    question: str,
    answer_prefix: str = "",
    layout: str = "one_turn",
    system: str | None = None,
) -> Prompt:
    """Lay out ``context`` and ``question`` (see the module docstring); return both parts as ids."""
    parts = _layout(tokenizer, layout, system, context, question)
    head_ids = _encode(tokenizer, parts.head)  # tokenised apart from the context, as in the repeat prompt
    end_ids = _encode(tokenizer, parts.end) if parts.end else []
    context_ids = head_ids + _encode(tokenizer, context) + end_ids
    question_ids = _encode(tokenizer, parts.opener + question + parts.tail + answer_prefix)
    return Prompt(
        torch.tensor([context_ids]), torch.tensor([question_ids]), len(head_ids), len(end_ids), parts.opener, parts.tail
    )


def template_tokens(tokenizer: Any, layout: str = "one_turn", system: str | None = None) -> int:
    """Tokens the chat template adds around a context and a question."""
    prompt = build_prompt(tokenizer, "", "", "", layout, system)
    return prompt.n_tokens


def truncate_middle(tokenizer: Any, context: str, question: str, budget: int) -> str:
    """``context`` cut in its middle so that context + question fit ``budget`` tokens, as LongBench cuts.

    LongBench keeps the first and the last ``budget // 2`` tokens of the whole prompt (the template filled
    with context and question) and decodes them; the question, at the end, survives whole. When the
    question alone passes half the budget, the context alone is cut around its middle instead.
    """
    ids = _encode(tokenizer, context + question)
    if len(ids) <= budget:
        return context
    half = budget // 2
    decode = lambda part: tokenizer.decode(part, skip_special_tokens=True)
    text = decode(ids[:half]) + decode(ids[len(ids) - half :])
    if text.endswith(question):
        return text[: len(text) - len(question)]
    context_ids = _encode(tokenizer, context)
    keep = max(budget - len(_encode(tokenizer, question)), 0)
    return decode(context_ids[: keep // 2]) + decode(context_ids[len(context_ids) - (keep - keep // 2) :])


@dataclass
class TemplatePieces:
    """Token ids of the chat template around the context: head + context + middle, then the repeat."""

    head: list[int]  # before the user content (system prompt, user header)
    middle: list[int]  # between the user content and the assistant content (end of turn, assistant header)


def template_pieces(tokenizer: Any) -> TemplatePieces:
    """The template ids around a user turn followed by an assistant turn."""
    if not getattr(tokenizer, "chat_template", None):  # a base model: its start token, then plain text
        bos = getattr(tokenizer, "bos_token_id", None)
        return TemplatePieces([] if bos is None else [int(bos)], _encode(tokenizer, "\n"))
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
