"""Long documents that carry many questions each: QuALITY, QASPER over full papers, LongHealth.

Each document is one sample: a method compresses it once and every question is answered from its own
copy of the compressed cache, as the Attention Matching paper evaluates.

* QuALITY (``conf/benchmark/quality.yaml``), as the Attention Matching code runs it: the article in a first
  user turn after its system prompt, each question with lettered options ("A. ...") and its instruction
  in a second turn, the letter parsed from the answer (``choice_letter``); rows in L-Eval's layout (the
  vendored subset, or the hub's ``L4NLP/LEval``) or in the official QuALITY schema (articles written by two
  writers are merged), tagged easy/hard there;
* QASPER full papers (``conf/benchmark/qasper.yaml``): L-Eval's ``scientific_qa`` rows with LongBench's
  qasper prompt, QA F1;
* LongHealth (``conf/benchmark/longhealth.yaml``): the official ``benchmark_v5.json`` (patients, their
  notes, 5-option questions), one patient per sample, notes wrapped as ``<text_i> ... </text_i>`` as the
  Attention Matching code does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from kvresearch.benchmarks.longbench import split_template
from kvresearch.benchmarks.sample import Question, Sample, Style
from kvresearch.errors import KVResearchError

_LEVAL_OPTION = re.compile(r"\n ?\(([A-D])\) ?")


def _style(cfg: Mapping[str, Any]) -> Style:
    return Style(str(cfg.get("layout", "two_turns")), cfg.get("system"), cfg.get("truncate"))


def choice_question(cfg: Mapping[str, Any], text: str, options: list[str], answer: str, **fields: Any) -> Question:
    """A multiple-choice question as the benchmark's template lays it out: question, lettered options, instruction."""
    letters = [chr(65 + i) for i in range(len(options))]
    listing = "\n".join(f"{letter}. {option}" for letter, option in zip(letters, options, strict=True))
    listed = ", ".join(letters[:-1]) + f", or {letters[-1]}"
    instruction = str(cfg["instruction"]).format(letters=listed)
    body = str(cfg.get("question", "{question}\n\n{options}\n\n{instruction}"))
    return Question(
        body.format(question=text, options=listing, instruction=instruction),
        references=(answer,),
        max_new_tokens=int(cfg["max_new_tokens"]),
        choices=tuple(options),
        **fields,
    )


def _capped(rows: Iterable[Mapping[str, Any]], cfg: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    cap = cfg.get("max_documents")
    rows = list(rows)
    return rows[: int(cap)] if cap is not None else rows


def quality_leval_rows(data: Iterable[Mapping[str, Any]], cfg: Mapping[str, Any], part: Any) -> list[Sample]:
    """QuALITY in L-Eval's layout: ``input`` (article), ``instructions`` (question + "(A) ..."), ``outputs``."""
    out = []
    for index, row in enumerate(_capped(data, cfg)):
        questions = []
        for q, (instruction, gold) in enumerate(zip(row["instructions"], row["outputs"], strict=True)):
            pieces = _LEVAL_OPTION.split(instruction)  # [question, "A", text, "B", text, ...]
            options = [text.strip() for text in pieces[2::2]]
            gold = gold.strip()
            if len(options) != 4 or not re.match(r"\([A-D]\)", gold):
                raise KVResearchError(f"QuALITY row {index}, question {q}: not L-Eval's 4-option layout.")
            questions.append(choice_question(cfg, pieces[0].strip(), options, gold[1], id=f"{index}/{q}"))
        out.append(
            Sample(
                "quality",
                "quality",
                index,
                str(row["input"]).strip(),
                tuple(questions),
                "choice_letter",
                style=_style(cfg),
                id=str(index),
            )
        )
    return out


def quality_official_rows(data: Iterable[Mapping[str, Any]], cfg: Mapping[str, Any], part: Any) -> list[Sample]:
    """QuALITY in its official schema (``article_id``, ``article``, ``questions[question, options, gold_label]``)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for row in data:  # two writers' lines per article: one document, all their questions
        key = (str(row["article_id"]), str(row["article"]).strip())
        merged.setdefault(key, {"article": key[1], "questions": []})["questions"].extend(row.get("questions") or [])
    out = []
    for index, ((article_id, article), doc) in enumerate(list(merged.items())[: cfg.get("max_documents")]):
        questions = tuple(
            choice_question(
                cfg,
                q["question"],
                list(q["options"]),
                chr(64 + int(q["gold_label"])),
                tags={"difficulty": "hard" if q.get("difficult") else "easy"},
                id=q.get("question_unique_id"),
            )
            for q in doc["questions"]
        )
        out.append(
            Sample("quality", "quality", index, article, questions, "choice_letter", style=_style(cfg), id=article_id)
        )
    return out


def qasper_leval_rows(data: Iterable[Mapping[str, Any]], cfg: Mapping[str, Any], part: Any) -> list[Sample]:
    """QASPER full papers in L-Eval's layout (``input``, ``instructions``, ``outputs``) with LongBench's prompt."""
    context_t, question_t = split_template(str(cfg["prompt"]))
    out = []
    for index, row in enumerate(_capped(data, cfg)):
        questions = tuple(
            Question(
                question_t.format(input=q),
                references=(str(a),),
                max_new_tokens=int(cfg["max_new_tokens"]),
                id=f"{index}/{i}",
            )
            for i, (q, a) in enumerate(zip(row["instructions"], row["outputs"], strict=True))
        )
        context = context_t.format(context=str(row["input"]))
        out.append(Sample("qasper", "qasper", index, context, questions, "qa_f1", style=_style(cfg), id=str(index)))
    return out


def longhealth_rows(data: Iterable[Mapping[str, Any]], cfg: Mapping[str, Any], part: Any) -> list[Sample]:
    """LongHealth's ``benchmark_v5.json`` (a dict of patients, read as rows with ``_key``), one patient per sample."""
    out = []
    for index, patient in enumerate(_capped(sorted(data, key=lambda row: str(row["_key"])), cfg)):
        notes = "\n\n".join(f"<{key}>\n{text}\n</{key}>" for key, text in patient["texts"].items()).strip()
        questions = []
        for q in patient["questions"]:
            options = [str(q[f"answer_{x}"]) for x in "abcde"]
            matches = [i for i, option in enumerate(options) if option.strip() == str(q["correct"]).strip()]
            if not matches:
                raise KVResearchError(
                    f"LongHealth {patient['_key']}, question {q.get('No')}: 'correct' is none of the options."
                )
            questions.append(
                choice_question(
                    cfg, q["question"], options, chr(65 + matches[0]), id=f"{patient['_key']}_q{q.get('No')}"
                )
            )
        out.append(
            Sample(
                "longhealth",
                "longhealth",
                index,
                notes,
                tuple(questions),
                "choice_letter",
                style=_style(cfg),
                id=str(patient["_key"]),
            )
        )
    return out
