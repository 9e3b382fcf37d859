"""The sample type every benchmark loader produces.

A sample is one context with one or more questions about it. The context is what a method compresses,
once; each question is answered from its own copy of the compressed cache (the query-agnostic protocol
of KVzip and Attention Matching). Identity is carried by fields (benchmark, task, length, index, the
dataset's own id), never by strings to parse; :attr:`Sample.key` is only their printed form.

How the prompt is laid out is the sample's ``style`` (the benchmark's rule, e.g. LongBench's tasks that
get no chat template): ``one_turn`` (context and question in one user turn, kvpress's layout),
``two_turns`` (the context in a first user turn, the question in a second; the Attention Matching code's
layout), ``plain`` (no chat template); an optional system prompt; ``truncate="middle"`` cuts a prompt
that exceeds the model's budget in its middle, as LongBench does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LAYOUTS = ("one_turn", "two_turns", "plain")


@dataclass(frozen=True)
class Question:
    """A question about a sample's context, with its accepted answers."""

    text: str  # fed after the (compressed) context
    answer_prefix: str = ""  # appended after the end of the user turn, before generation
    references: tuple[str, ...] = ()  # accepted answers, as the metric takes them (a letter for choices)
    max_new_tokens: int = 32
    choices: tuple[str, ...] = ()  # option texts of a multiple-choice question, lettered A, B, ...
    tags: dict[str, str] = field(default_factory=dict)  # groups it is also reported by (difficulty, ...)
    id: str | None = None  # the dataset's own id
    followup: str | None = None  # a second step without the context; "$COT$" takes the first answer (v2's CoT)


@dataclass(frozen=True)
class Style:
    """How a sample's prompt is laid out (see the module docstring)."""

    layout: str = "one_turn"
    system: str | None = None
    truncate: str | None = None  # "middle": LongBench's cut of a prompt longer than the model's budget

    def __post_init__(self) -> None:
        """A known layout and truncation."""
        if self.layout not in LAYOUTS or self.truncate not in (None, "middle"):
            raise ValueError(f"layout must be one of {LAYOUTS} and truncate null or 'middle', got {self}")


@dataclass(frozen=True)
class Sample:
    """One context and its questions (see the module docstring)."""

    benchmark: str
    task: str
    index: int  # position within (task, length)
    context: str
    questions: tuple[Question, ...]
    metric: str  # a name in ``benchmarks.metrics.METRICS``
    length: int | None = None  # target length in tokens, for benchmarks generated at set lengths
    metric_options: dict[str, Any] = field(default_factory=dict)  # e.g. LongBench's all_classes, first_line
    style: Style = Style()
    id: str | None = None  # the dataset's own id

    @property
    def group(self) -> str:
        """The group results are reported by: ``task@length``, or the task."""
        return self.task if self.length is None else f"{self.task}@{self.length}"

    @property
    def key(self) -> str:
        """Printed identity: ``<group>#<index>``."""
        return f"{self.group}#{self.index}"

    def record_id(self, question: int) -> str:
        """Identity of one answer: the sample's key, with ``/<question>`` when it has several questions."""
        return self.key if len(self.questions) == 1 else f"{self.key}/{question}"
