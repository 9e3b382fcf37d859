"""Samples from a benchmark config (``conf/benchmark/<name>.yaml``): one entry point per source kind.

* ``generate``: the config's ``generator`` (a dotted path) makes the samples, e.g. RULER over packaged data;
* ``hub``: a Hugging Face dataset (``hub.path``, ``hub.split``), one dataset config per part
  (``hub.configs``: RULER's lengths, LongBench's tasks; null for one);
* ``files``: the same rows from local files, ``files.folder/<part>.jsonl`` (or ``.json``, ``.parquet``)
  for each part of ``files.names``: the vendored offline copies, and the hub's schema for tests.

For hub and files, the config's ``rows`` function (a dotted path) turns one part's rows into samples:
``rows(rows, cfg, part)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from hydra.utils import get_method

from kvresearch.benchmarks.sample import Sample
from kvresearch.errors import KVResearchError

SUFFIXES = (".jsonl", ".json", ".parquet")


def _function(cfg: Mapping[str, Any], key: str) -> Callable[..., Any]:
    if not cfg.get(key):
        raise KVResearchError(f"benchmark '{cfg['name']}' (source={cfg['source']}) needs '{key}' in its config.")
    return get_method(str(cfg[key]))


def generated(cfg: Mapping[str, Any], tokenizer: Any) -> list[Sample]:
    """``source: generate``: the samples of the config's generator."""
    return list(_function(cfg, "generator")(cfg, tokenizer))


def from_hub(cfg: Mapping[str, Any], tokenizer: Any) -> list[Sample]:
    """``source: hub``: a Hugging Face dataset, one dataset config per part."""
    from datasets import load_dataset

    hub = cfg.get("hub") or {}
    samples: list[Sample] = []
    for part in hub.get("configs") or [None]:
        name = None if part is None else str(part)
        try:
            rows = load_dataset(str(hub["path"]), name, split=str(hub.get("split", "test")))
        except Exception as error:  # the hub raises many types; all mean the same here
            raise KVResearchError(
                f"Could not load {hub.get('path')} ({name or 'default'}) from the Hugging Face hub "
                f"({type(error).__name__}: {str(error)[:200]}). Offline, use local files in the same schema "
                "(benchmark.source=files benchmark.files.folder=<folder>) or the benchmark's vendored copy."
            ) from error
        samples += _function(cfg, "rows")(rows, cfg, part)
    return samples


def read_rows(path: Path) -> Iterable[Mapping[str, Any]]:
    """Rows of a JSON Lines, JSON (a list, or a dict of records) or parquet file."""
    if path.suffix == ".parquet":
        from datasets import load_dataset

        return load_dataset("parquet", data_files=str(path), split="train")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    return data if isinstance(data, list) else [{"_key": k, **v} for k, v in data.items()]


def part_file(cfg: Mapping[str, Any], part: Any) -> Path:
    """The local file of one part: ``files.folder/<part>`` with a known suffix."""
    folder = Path(str((cfg.get("files") or {}).get("folder") or ""))
    found = [folder / f"{part}{s}" for s in SUFFIXES if (folder / f"{part}{s}").is_file()] if folder.is_dir() else []
    if not found:
        raise KVResearchError(
            f"benchmark '{cfg['name']}' (source=files): no {part}.jsonl, .json or .parquet in benchmark.files.folder "
            f"'{folder}'. Point it at a folder holding one file per part, in the hub dataset's schema."
        )
    return found[0]


def from_files(cfg: Mapping[str, Any], tokenizer: Any) -> list[Sample]:
    """``source: files``: local files in the hub dataset's schema, one per part."""
    samples: list[Sample] = []
    for part in (cfg.get("files") or {}).get("names") or []:
        samples += _function(cfg, "rows")(read_rows(part_file(cfg, part)), cfg, part)
    return samples


SOURCES: dict[str, Callable[[Mapping[str, Any], Any], list[Sample]]] = {
    "generate": generated,
    "hub": from_hub,
    "files": from_files,
}


def load_samples(cfg: Mapping[str, Any], tokenizer: Any) -> list[Sample]:
    """The samples a benchmark config describes."""
    source = str(cfg.get("source"))
    if source not in SOURCES:
        raise KVResearchError(f"benchmark.source must be one of {sorted(SOURCES)}, got {source!r}.")
    samples = SOURCES[source](cfg, tokenizer)
    if not samples:
        raise KVResearchError(f"benchmark '{cfg['name']}' ({source}) produced no samples: check its tasks and lengths.")
    return samples


def calibration_samples(cfg: Mapping[str, Any], tokenizer: Any, evaluated: list[Sample], count: int) -> list[Sample]:
    """``count`` samples held out from ``evaluated``, spread evenly over the benchmark's tasks, for calibration.

    A generated benchmark with a ``seed`` is generated again with the next seed (new contexts, same
    tasks); otherwise the samples are those of the benchmark (its per-task and document caps lifted) that
    ``evaluated`` leaves out, none sharing a context with an evaluated one.
    """
    if count < 1:
        raise KVResearchError(f"evaluate.calibration_samples must be at least 1, got {count}.")
    if cfg.get("source") == "generate" and cfg.get("seed") is not None:
        pool = load_samples({**cfg, "seed": int(cfg["seed"]) + 1}, tokenizer)
    else:  # the caps lifted: the rows past them are the held-out ones
        uncapped = {**cfg, **{k: None for k in ("samples_per_task", "max_documents") if k in cfg}}
        contexts = {s.context for s in evaluated}
        pool = [s for s in load_samples(uncapped, tokenizer) if s.context not in contexts]
    if not pool:
        raise KVResearchError(
            f"benchmark '{cfg['name']}': every sample is evaluated, none is left to calibrate the threshold on. "
            "Lower evaluate.max_samples (or benchmark.max_documents), or set method.threshold instead of "
            "method.calibrate=true."
        )
    step = max(len(pool) / count, 1.0)
    return [pool[int(i * step)] for i in range(min(count, len(pool)))]
