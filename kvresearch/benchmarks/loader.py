"""Benchmark samples from config: RULER generated offline, or kvpress's RULER dataset from the hub.

Every sample gets an ``id`` ("<task>@<length>#<index>") and a ``metric`` name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvresearch.benchmarks import ruler
from kvresearch.errors import KVResearchError

KVPRESS_RULER = "simonjegou/ruler"


def _hub_ruler(cfg: Mapping[str, Any], length: int) -> list[dict[str, Any]]:
    from datasets import load_dataset

    try:
        if cfg.get("data_files"):
            rows = load_dataset("parquet", data_files=str(cfg["data_files"]).format(length=length), split="train")
        else:
            rows = load_dataset(cfg.get("hub_name", KVPRESS_RULER), str(length), split="test")
    except Exception as error:  # the hub raises many types; all mean the same here
        raise KVResearchError(
            f"Could not load kvpress's RULER ({cfg.get('hub_name', KVPRESS_RULER)}, {length}) from the hub "
            f"({type(error).__name__}); offline, use benchmark.source=generate."
        ) from error
    return [dict(r) for r in rows]


def load_samples(cfg: Mapping[str, Any], tokenizer: Any) -> list[dict[str, Any]]:
    """Samples of ``cfg`` (conf/benchmark/*.yaml), each with id, task, metric and the kvpress fields."""
    if cfg["name"] != "ruler":
        raise KVResearchError(f"benchmark '{cfg['name']}' has no loader yet; available: ruler.")
    tasks = list(cfg["tasks"])
    unknown = sorted(set(tasks) - set(ruler.TASKS))
    if unknown:
        raise KVResearchError(f"Unknown RULER tasks {unknown}; choose from {sorted(ruler.TASKS)}.")
    samples = []
    for length in cfg["lengths"]:
        if cfg.get("source", "generate") == "hub":
            rows = [r for r in _hub_ruler(cfg, int(length)) if r["task"] in tasks]
            per_task: dict[str, int] = {}
            for row in rows:
                i = per_task.get(row["task"], 0)
                if i < int(cfg["samples_per_task"]):
                    per_task[row["task"]] = i + 1
                    answer = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
                    samples.append({**row, "answer": list(answer), "id": f"{row['task']}@{length}#{i}"})
        else:
            for task in tasks:
                for i in range(int(cfg["samples_per_task"])):
                    sample = ruler.make_sample(task, tokenizer, int(length), int(cfg.get("seed", 42)), i)
                    samples.append({**sample, "id": f"{task}@{length}#{i}"})
    for sample in samples:
        sample["metric"] = ruler.METRIC[ruler.TASKS[sample["task"]]["task"]]
    return samples
