"""AIME 2024 and 2025: one problem per sample, no document, answers integers 0-999.

The problem is the question (there is nothing to compress before it): compression acts while decoding
(KVzap's threshold, a decoding press, re-compression), which is what the KVzap paper's AIME25 table
measures. Rows: the vendored files (``question``, ``answer``) or the hub's schemas (``problem``/``Problem``,
``answer``/``Answer``, ``id``/``ID``); ids by position where the rows carry none (see the data's PROVENANCE).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvresearch.benchmarks.sample import Question, Sample, Style
from kvresearch.errors import KVResearchError


def _field(row: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if row.get(name) is not None:
            return row[name]
    raise KVResearchError(f"AIME row without any of the fields {names}: {sorted(row)}.")


def position_id(year: str, index: int, per_contest: int = 15) -> str:
    """``2025-I-1`` ... ``2025-II-15`` for the 30 problems of a year in contest order."""
    contest = "I" if index < per_contest else "II"
    return f"{year}-{contest}-{index % per_contest + 1}"


def rows(data: Iterable[Mapping[str, Any]], cfg: Mapping[str, Any], part: Any) -> list[Sample]:
    """One sample per problem, its question laid out by the config's ``question`` template."""
    out = []
    ids = str(cfg.get("ids", "position"))
    for index, row in enumerate(list(data)[: cfg.get("max_problems")]):
        answer = str(_field(row, "answer", "Answer")).strip()
        if not answer.isdigit() or not 0 <= int(answer) <= 999:
            raise KVResearchError(f"AIME row {index}: the answer {answer!r} is not an integer 0-999.")
        if ids == "position":
            own = position_id(str(cfg["year"]), index)
        elif ids == "index":
            own = f"aime{str(cfg['year'])[-2:]}-{index + 1:02d}"
        else:
            own = str(_field(row, "id", "ID"))
        problem = str(_field(row, "question", "problem", "Problem")).strip()
        question = Question(
            str(cfg["question"]).format(question=problem),
            references=(str(int(answer)),),
            max_new_tokens=int(cfg["max_new_tokens"]),
            id=own,
        )
        out.append(Sample(str(cfg["name"]), str(cfg["name"]), index, "", (question,), "aime", style=Style(), id=own))
    return out
