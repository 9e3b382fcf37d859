"""LongBench v1 and v2 (THUDM/LongBench): rows of the official files into samples.

v1 (``conf/benchmark/longbench.yaml``): each task's official prompt (``dataset2prompt.json``) is split
where the question begins, so that the context part is what a method compresses and the rest (question,
instructions, "Answer:") follows it; context + question is the official prompt, character for character.
The official generation lengths (``dataset2maxlen.json``), middle truncation to the model's budget, the
official rule of which tasks get no chat template (trec, triviaqa, samsum, lsht, lcc, repobench-p: plain
text), the official metric of each task, and its first-line rule. Every row is tagged with its
LongBench-E length bucket (0-4k, 4-8k, 8k+ words).

v2 (``conf/benchmark/longbench_v2.yaml``): 4-option questions with the official templates (``0shot``, or
``0shot_cot`` whose chain of thought is then answered by ``0shot_cot_ans`` without the document), the
official answer extraction, middle truncation; tagged by difficulty, length and domain.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvresearch.benchmarks.sample import Question, Sample, Style
from kvresearch.errors import KVResearchError


def split_template(template: str) -> tuple[str, str]:
    """(context part, question part) of an official LongBench prompt; their concatenation is the template.

    The question part starts at the line holding ``{input}`` (or right after ``{context}`` when both share
    a line, as in the code tasks); without ``{input}``, after the first blank line following ``{context}``.
    """
    end = template.index("{context}") + len("{context}")
    if "{input}" in template:
        start = max(template.rfind("\n", 0, template.index("{input}")) + 1, end)
    else:
        blank = template.find("\n\n", end)
        start = blank + 2 if blank >= 0 else end
    return template[:start], template[start:]


def length_bucket(words: int) -> str:
    """LongBench-E's bucket of a row's ``length`` (words)."""
    return "0-4k" if words < 4000 else "4-8k" if words < 8000 else "8k+"


def _task(cfg: Mapping[str, Any], task: str) -> Mapping[str, Any]:
    tasks = cfg.get("definitions") or {}
    if task not in tasks:
        raise KVResearchError(f"Unknown LongBench task {task!r}; choose from {sorted(tasks)}.")
    return tasks[task]


def rows(data: Iterable[Mapping[str, Any]], cfg: Mapping[str, Any], task: str) -> list[Sample]:
    """Samples of one LongBench v1 task (``task``: the part); at most ``samples_per_task``."""
    spec = _task(cfg, str(task).removesuffix("_e"))  # LongBench-E's configs share their task's definition
    context_t, question_t = split_template(str(spec["prompt"]))
    style = Style("one_turn" if spec.get("chat", True) else "plain", truncate="middle")
    cap = cfg.get("samples_per_task")
    out = []
    for index, row in enumerate(data):
        if cap is not None and index >= int(cap):
            break
        fields = dict(row)
        tags = {"length_bucket": length_bucket(int(row["length"]))} if row.get("length") is not None else {}
        question = Question(
            question_t.format(**fields),
            references=tuple(str(a) for a in row["answers"]),
            max_new_tokens=int(spec["max_new_tokens"]),
            tags=tags,
            id=str(row.get("_id", index)),
        )
        options: dict[str, Any] = {"first_line": bool(spec.get("first_line", False))}
        if row.get("all_classes"):
            options["all_classes"] = list(row["all_classes"])
        context = context_t.format(**fields)
        out.append(
            Sample(
                "longbench",
                str(task),
                index,
                context,
                (question,),
                str(spec["metric"]),
                metric_options=options,
                style=style,
                id=question.id,
            )
        )
    return out


def _fill(template: str, row: Mapping[str, Any], cot: str = "") -> str:
    """An official v2 template with the row's fields (stripped, as the official script does)."""
    text = template.replace("$Q$", str(row["question"]).strip())
    for letter in "ABCD":
        text = text.replace(f"$C_{letter}$", str(row[f"choice_{letter}"]).strip())
    return text.replace("$COT$", cot)


def v2_rows(data: Iterable[Mapping[str, Any]], cfg: Mapping[str, Any], part: Any) -> list[Sample]:
    """Samples of LongBench v2 (rows with ``context``); ``prompt`` picks the template (``0shot``, ``0shot_cot``)."""
    prompts = cfg["prompts"]
    name = str(cfg.get("prompt", "0shot"))
    if name not in ("0shot", "0shot_cot"):
        raise KVResearchError(f"benchmark.prompt must be 0shot or 0shot_cot, got {name!r}.")
    context_t, question_t = str(prompts[name]).split("$DOC$")
    head, _, rest = question_t.partition("\n\n")  # "</text>" closes the document; the question starts after it
    context_t, question_t = context_t + "$DOC$" + head + "\n\n", rest
    out: list[Sample] = []
    cap = cfg.get("samples_per_task")
    for row in data:
        if cap is not None and len(out) >= int(cap):
            break
        if "context" not in row:
            raise KVResearchError("LongBench v2 rows need their 'context'; the question-only file cannot be run.")
        tags = {k: str(row[k]) for k in ("difficulty", "length", "domain") if k in row}
        followup = _fill(str(prompts["0shot_cot_ans"]), row, "$COT$") if name == "0shot_cot" else None
        question = Question(
            _fill(question_t, row),
            references=(str(row["answer"]),),
            max_new_tokens=int(cfg["max_new_tokens"][name]),
            choices=tuple(str(row[f"choice_{x}"]).strip() for x in "ABCD"),
            tags=tags,
            id=str(row.get("_id", len(out))),
            followup=followup,
        )
        context = context_t.replace("$DOC$", str(row["context"]).strip())
        style = Style("one_turn", truncate="middle")
        out.append(
            Sample(
                "longbench_v2", "longbench_v2", len(out), context, (question,), "choice_v2", style=style, id=question.id
            )
        )
    return out
