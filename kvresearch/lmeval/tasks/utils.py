"""Datasets and scoring for the lm-eval tasks in this folder: kvresearch's benchmark configs, flattened.

Each task reads a ``conf/benchmark/<name>.yaml`` through kvresearch's own loader (the vendored offline
files by default; ``--metadata '{"source": "hub"}'`` sets any key of the benchmark config) and turns every
(sample, question) into one row: ``context`` (what the model compresses), ``question``, ``choices`` and
``target`` for multiple choice, ``references``, ``metric`` and its options, scored by kvresearch's metrics
(the official ones).
"""

from __future__ import annotations

import json
from typing import Any

import datasets


def load(benchmark: str, **overrides: Any) -> datasets.DatasetDict:
    """``custom_dataset``: the benchmark's samples as rows (``overrides``: benchmark config keys)."""
    from omegaconf import open_dict

    from kvresearch.benchmarks.loader import load_samples
    from kvresearch.runs import compose_config

    cfg = compose_config(f"benchmark/{benchmark}").benchmark
    with open_dict(cfg):
        for key, value in overrides.items():
            if key in cfg:  # lm-eval's metadata also carries the task version and the model's arguments
                cfg[key] = value
    rows = []
    for sample in load_samples(cfg, None):
        for q, question in enumerate(sample.questions):
            letters = [chr(65 + i) for i in range(len(question.choices))]
            reference = question.references[0] if question.references else ""
            rows.append(
                {
                    "id": sample.record_id(q),
                    "context": sample.context,
                    "question": question.text,
                    "choices": list(question.choices),
                    "target": letters.index(reference) if reference in letters else -1,
                    "references": list(question.references),
                    "metric": sample.metric,
                    "metric_options": json.dumps(sample.metric_options),
                }
            )
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def quality(**metadata: Any) -> datasets.DatasetDict:
    """QuALITY rows: one per question, the article as context, the bare question (options are the choices)."""
    return load("quality", **{"question": "{question}", **metadata})


def longbench_qasper(**metadata: Any) -> datasets.DatasetDict:
    """LongBench v1 qasper rows: the official prompt split where the question begins."""
    return load("longbench", tasks=["qasper"], **metadata)


def aime25(**metadata: Any) -> datasets.DatasetDict:
    """AIME 2025 rows: no context, the problem as the question."""
    return load("aime25", **metadata)


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """The benchmark's own metric of the generation."""
    from kvresearch.benchmarks.metrics import METRICS

    options = json.loads(doc["metric_options"])
    return {"score": METRICS[doc["metric"]](results[0], doc["references"], **options)}
