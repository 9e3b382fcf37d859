"""Samples from a benchmark config (``conf/benchmark/<name>.yaml``): one entry point per source kind.

* ``generate``: the config's ``generator`` (a dotted path) makes the samples, e.g. RULER over packaged data;
* ``hub``: rows of a Hugging Face dataset (``hub.path``, the length as config name where the benchmark has
  lengths, ``hub.split``), turned into samples by the config's ``rows`` function;
* ``files``: the same rows from local parquet or JSON Lines files (``files``: a folder of
  ``<length>.parquet``, a path with ``{length}``, or one file), for users without the hub and for
  tests of the hub schema.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hydra.utils import get_method

from kvresearch.benchmarks.sample import Sample
from kvresearch.errors import KVResearchError


def _function(cfg: Mapping[str, Any], key: str) -> Callable[..., Any]:
    if not cfg.get(key):
        raise KVResearchError(f"benchmark '{cfg['name']}' (source={cfg['source']}) needs '{key}' in its config.")
    return get_method(str(cfg[key]))


def _lengths(cfg: Mapping[str, Any]) -> list[int | None]:
    return [int(n) for n in cfg["lengths"]] if cfg.get("lengths") else [None]


def generated(cfg: Mapping[str, Any], tokenizer: Any) -> list[Sample]:
    """``source: generate``: the samples of the config's generator."""
    return list(_function(cfg, "generator")(cfg, tokenizer))


def from_hub(cfg: Mapping[str, Any], tokenizer: Any) -> list[Sample]:
    """``source: hub``: a Hugging Face dataset, one config per length where the benchmark has lengths."""
    from datasets import load_dataset

    hub = cfg.get("hub") or {}
    samples: list[Sample] = []
    for length in _lengths(cfg):
        name = None if length is None else str(length)
        try:
            rows = load_dataset(str(hub["path"]), name, split=str(hub.get("split", "test")))
        except Exception as error:  # the hub raises many types; all mean the same here
            raise KVResearchError(
                f"Could not load {hub.get('path')} ({name or 'default'}) from the Hugging Face hub "
                f"({type(error).__name__}: {str(error)[:200]}). Offline, use a local copy "
                f"(benchmark.source=files benchmark.files=<path with {{length}}>) or benchmark.source=generate "
                "where the benchmark has a generator."
            ) from error
        samples += _function(cfg, "rows")(rows, cfg, length)
    return samples


def _local_file(cfg: Mapping[str, Any], length: int | None) -> Path:
    """The file ``benchmark.files`` names for ``length``.

    A path with ``{length}``, a folder holding ``<length>.parquet`` / ``<length>.jsonl``, or one file.
    """
    given = str(cfg.get("files") or "")
    path = Path(given.format(length=length)) if "{length}" in given else Path(given)
    if given and path.is_dir():
        path = next(
            (path / f"{length}{ext}" for ext in (".parquet", ".jsonl") if (path / f"{length}{ext}").is_file()), path
        )
    if not given or not path.is_file():
        raise KVResearchError(
            f"benchmark.source=files needs benchmark.files: a folder with <length>.parquet or <length>.jsonl, a "
            f"path with {{length}}, or one file; '{given}' gives no file for length {length}."
        )
    return path


def from_files(cfg: Mapping[str, Any], tokenizer: Any) -> list[Sample]:
    """``source: files``: local parquet or JSON Lines files in the hub dataset's schema."""
    from datasets import load_dataset

    samples: list[Sample] = []
    for length in _lengths(cfg):
        path = _local_file(cfg, length)
        rows = load_dataset("parquet" if path.suffix == ".parquet" else "json", data_files=str(path), split="train")
        samples += _function(cfg, "rows")(rows, cfg, length)
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
