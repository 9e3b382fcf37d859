"""The sample type every benchmark loader produces.

A sample is one context with one or more questions about it. The context is what a method compresses,
once; each question is answered from its own copy of the compressed cache (the query-agnostic protocol
of KVzip and Attention Matching). Identity is carried by fields (benchmark, task, length, index), never
by strings to parse; :attr:`Sample.key` is only their printed form.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Question:
    """A question about a sample's context, with its accepted answers."""

    text: str  # fed after the (compressed) context
    answer_prefix: str = ""  # appended after the end of the user turn, before generation
    references: tuple[str, ...] = ()  # accepted answers, as the metric takes them
    max_new_tokens: int = 32


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
