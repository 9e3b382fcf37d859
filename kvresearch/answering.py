"""From a sample to prompts, and from a compressed cache to an answer.

Prompts follow the sample's style (``benchmarks/sample.py``). A prompt whose tokens and the tokens to
generate exceed the model's budget (``model.max_context``, or ``benchmark.max_prompt_tokens`` when lower)
is cut in the middle where the benchmark defines that cut (LongBench), and refused otherwise, with the
lengths (RULER defines none).

Answers: generation, greedy unless ``evaluate.sampling`` (or the benchmark's own ``sampling``, AIME's)
says otherwise, ``n`` samples per question; or, for a multiple-choice question with
``evaluate.choices=loglikelihood``, the option whose text is most likely after the question (lm-eval's
``acc``; the length-normalised choice, ``acc_norm``, is recorded beside it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvresearch.benchmarks.sample import Question, Sample
from kvresearch.errors import KVResearchError
from kvresearch.generation import GREEDY, Sampling
from kvresearch.models.cache import RaggedCache
from kvresearch.models.session import Session, dense_answer
from kvresearch.prompts import Prompt, build_prompt, template_tokens, truncate_middle

CHOICE_MODES = ("generate", "loglikelihood")
FOLLOWUP_TOKENS = 128  # LongBench v2's answer step after a chain of thought


@dataclass
class Settings:
    """How a run answers: the evaluate config plus the model's position budget."""

    query_aware: bool = False
    fidelity: bool = True
    max_new_tokens: int | None = None  # cap on each question's own generation length
    max_context: int | None = None  # the prompt budget: the model's positions, or less
    choices: str = "generate"  # multiple choice: generate and parse the letter, or score the options
    sampling: Sampling = GREEDY

    def __post_init__(self) -> None:
        """A known choice mode."""
        if self.choices not in CHOICE_MODES:
            raise KVResearchError(f"evaluate.choices must be one of {CHOICE_MODES}, got {self.choices!r}.")

    @classmethod
    def from_config(
        cls, evaluate: Mapping[str, Any], model: Mapping[str, Any], benchmark: Mapping[str, Any] | None = None
    ) -> Settings:
        """From the ``evaluate``, ``model`` and ``benchmark`` config groups."""
        cap = evaluate.get("max_new_tokens")
        benchmark = benchmark or {}
        limits = [n for n in (model.get("max_context"), benchmark.get("max_prompt_tokens")) if n]
        sampling = evaluate.get("sampling") or benchmark.get("sampling")
        return cls(
            bool(evaluate["query_aware"]),
            bool(evaluate["fidelity"]),
            int(cap) if cap else None,
            min(int(n) for n in limits) if limits else None,
            str(evaluate.get("choices", "generate")),
            Sampling(**sampling) if sampling else GREEDY,
        )

    def new_tokens(self, asked: int) -> int:
        """Tokens to generate for a question that asks for ``asked``."""
        return min(asked, self.max_new_tokens) if self.max_new_tokens else asked


def prompts_of(tokenizer: Any, sample: Sample, settings: Settings) -> list[Prompt]:
    """One prompt per question, cut where the sample's benchmark cuts; query-aware prompts compress the question."""
    return [_prompt(tokenizer, sample, q, settings) for q in sample.questions]


def _prompt(tokenizer: Any, sample: Sample, q: Question, settings: Settings) -> Prompt:
    style, context = sample.style, sample.context

    def build(context: str) -> Prompt:
        parts = (context + "\n" + q.text, "") if settings.query_aware else (context, q.text)
        return build_prompt(tokenizer, *parts, q.answer_prefix, style.layout, style.system)

    prompt = build(context)
    if style.truncate != "middle" or not settings.max_context:
        return prompt
    new = settings.new_tokens(q.max_new_tokens)
    budget = settings.max_context - template_tokens(tokenizer, style.layout, style.system) - new
    for _ in range(4):  # pieces tokenised apart can take a token or two more than the text cut as a whole
        if prompt.n_tokens + new <= settings.max_context:
            return prompt
        prompt = build(truncate_middle(tokenizer, context, q.text + q.answer_prefix, budget))
        budget -= max(prompt.n_tokens + new - settings.max_context, 0)
    return prompt


def check_lengths(samples: list[Sample], prompts: list[list[Prompt]], settings: Settings) -> None:
    """Refuse answers whose prompt and generation exceed the budget (and say that nothing was cut)."""
    if not settings.max_context:
        return
    too_long = [
        (s.record_id(i), p.context_ids.shape[1], p.question_ids.shape[1], settings.new_tokens(q.max_new_tokens))
        for s, ps in zip(samples, prompts, strict=True)
        for i, (q, p) in enumerate(zip(s.questions, ps, strict=True))
        if p.n_tokens + settings.new_tokens(q.max_new_tokens) > settings.max_context
    ]
    if too_long:
        rid, ctx, question, new = too_long[0]
        raise KVResearchError(
            f"{len(too_long)} answer(s) would not fit the budget of {settings.max_context} positions "
            f"(model.max_context, or benchmark.max_prompt_tokens): {rid} needs {ctx + question + new} positions "
            f"(context {ctx} + question {question} + up to {new} new tokens). Nothing is cut where the benchmark "
            "defines no truncation (RULER); where it does, the question alone is too long. Lower benchmark.lengths "
            "(or evaluate.max_new_tokens), raise the budget, or use a model with more positions."
        )


@dataclass
class Answer:
    """What one question got: tokens, text, seconds, and the option scores of a choice question."""

    tokens: list[int]
    text: str
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    logprobs: list[float] | None = None  # of each token where it was generated (None: not generated)


@torch.no_grad()
def option_logprobs(session: Session, cache: RaggedCache, question_ids: torch.Tensor, option: str) -> float:
    """Sum of the log-probabilities of `` option`` after the question, under ``cache`` (left untouched)."""
    target = session.tokenizer(" " + option, add_special_tokens=False).input_ids
    logprobs = torch.log_softmax(session.target_logits(cache, question_ids, target).float(), dim=-1)
    return float(logprobs.gather(1, torch.tensor(target, device=logprobs.device)[:, None]).sum())


def respond(
    session: Session,
    cache: RaggedCache,
    prompt: Prompt,
    question: Question,
    settings: Settings,
    decode_context: Callable[[RaggedCache], AbstractContextManager[Any]] | None = None,
    sample: int = 0,
) -> Answer:
    """The answer to ``question`` from ``cache``: generated (sample ``sample``), or the most likely option.

    See the module docstring; a generated answer's extra fields say why it stopped and the KV bytes held.
    """
    if settings.choices == "loglikelihood" and question.choices:
        start = time.perf_counter()
        scores = [option_logprobs(session, cache, prompt.question_ids, option) for option in question.choices]
        normed = [s / max(len(o.encode()), 1) for s, o in zip(scores, question.choices, strict=True)]
        best = max(range(len(scores)), key=scores.__getitem__)
        letter = chr(65 + best)
        tokens = session.tokenizer(" " + question.choices[best], add_special_tokens=False).input_ids
        extra = {
            "option_logprobs": scores,
            "acc_norm_choice": chr(65 + max(range(len(normed)), key=normed.__getitem__)),
        }
        return Answer(tokens, letter, time.perf_counter() - start, extra)
    max_new = settings.new_tokens(question.max_new_tokens)
    out = session.generate(cache, prompt.question_ids, max_new, settings.sampling, sample, decode_context)
    tokens, seconds = out.tokens, out.seconds
    text = session.tokenizer.decode(tokens, skip_special_tokens=True)
    extra = {"stop_reason": out.stop_reason, **out.kv.as_record()}
    if question.followup is None:
        return Answer(tokens, text, seconds, extra, out.logprobs)
    # A chain of thought is answered in a second step without the document (LongBench v2's 0shot_cot_ans).
    second = build_prompt(session.tokenizer, "", question.followup.replace("$COT$", text.strip()))
    final = dense_answer(session, second, FOLLOWUP_TOKENS)
    final_text = session.tokenizer.decode(final.token_ids, skip_special_tokens=True)
    extra["chain_of_thought"] = text
    return Answer(tokens, final_text, seconds + final.prefill_s + final.decode_s, extra, out.logprobs)
