"""Run records: a finished run folder as one JSON file in the repository, so a table outlives the machine.

Run folders live under the outputs root, which a fresh clone, a new machine or a cluster's scratch space
does not share. A record (``docs/results/runs/<stage>/<run name>.json``, named like the run folder) holds
what a table and a later run need from it: the resolved config, the versions and commit it ran at, its
``DONE`` stamp, its metrics and its per-answer predictions. ``make table-<name>`` writes the records of the
finished cells it finds and reads a record for any cell whose run folder is not on this machine, so cells
run on different machines (or on a cluster, records committed from there) meet in one table.

A record is written atomically, only from a finished run, and only from a run made at a clean commit (or,
when asked, with the diff it ran with), so every committed number can be rerun; paths in it are relative to
the outputs root and the checkout (``<outputs>/...``, ``<checkout>/...``), so it reads the same on any
machine. One that cannot be read is an error naming the file, never a cell taken as finished.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from kvresearch.errors import KVResearchError
from kvresearch.runs.files import read_json, write_atomic
from kvresearch.runs.naming import is_done, repo_root

RECORDS_ENV = "KVRESEARCH_RECORDS"
DIRTY_ENV = "KVRESEARCH_RECORD_DIRTY"  # 1: record runs made from uncommitted changes too (with their diff)
FORMAT = 1
ANSWERS = ("predictions.jsonl", "generations.jsonl")  # per-answer records: an evaluate run's, a fidelity run's
KEYS = ("format", "stage", "run", "config", "versions", "done", "metrics", "predictions")


def records_root() -> Path:
    """Where run records live: ``$KVRESEARCH_RECORDS``, else ``docs/results/runs/`` in the checkout."""
    return Path(os.environ.get(RECORDS_ENV) or repo_root() / "docs" / "results" / "runs").expanduser()


def path_of(records: Path, folder: Path) -> Path:
    """The record of run ``folder`` (``<outputs>/<stage>/<name>``): ``<records>/<stage>/<name>.json``."""
    folder = Path(folder)
    return Path(records) / folder.parent.name / f"{folder.name}.json"


def portable(value: Any, roots: dict[str, str]) -> Any:
    """``value`` with every absolute path under one of ``roots`` (label -> folder) written ``<label>/rest``.

    Through nested dicts and lists, so a record reads the same on every machine.
    """
    if isinstance(value, dict):
        return {k: portable(v, roots) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, roots) for v in value]
    if isinstance(value, str) and value.startswith("/"):
        for label, root in roots.items():
            if root and (value == root or value.startswith(root + "/")):
                return f"<{label}>{value[len(root) :]}"
    return value


def write(folder: Path, records: Path, allow_dirty: bool = False) -> Path | None:
    """Record the finished run ``folder`` under ``records``; its path, or None when it was not recorded.

    None when the run is not finished, or when it ran from a working tree with uncommitted changes unless
    ``allow_dirty`` (or ``$KVRESEARCH_RECORD_DIRTY=1``): then the record keeps the diff (``versions.git``).

    Paths under the run's outputs root and checkout are written ``<outputs>/...`` and ``<checkout>/...``.
    A record already holding this run's ``DONE`` stamp is left as it is (no churn in the repository).
    """
    folder = Path(folder)
    if not is_done(folder):
        return None
    done = (folder / "DONE").read_text(encoding="utf-8").strip()
    path = path_of(records, folder)
    if path.is_file():
        try:
            if json.loads(path.read_text(encoding="utf-8")).get("done") == done:
                return path
        except (ValueError, AttributeError):
            pass  # a damaged record, or not one: written again below
    fix = f"Re-run that run with force=true ({folder})."
    versions = read_json(folder / "versions.json", fix)
    if (versions.get("git") or {}).get("dirty") and not (allow_dirty or os.environ.get(DIRTY_ENV) == "1"):
        return None
    found = [folder / name for name in ANSWERS if (folder / name).is_file()]
    lines = found[0].read_text(encoding="utf-8").splitlines() if found else []
    config = OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"), resolve=False)
    assert isinstance(config, dict)
    roots = {"outputs": str(config.get("paths", {}).get("root") or folder.parent.parent).rstrip("/"),
             "checkout": str(versions.get("checkout") or repo_root()).rstrip("/")}  # fmt: skip
    record = portable(
        {
            "format": FORMAT,
            "stage": folder.parent.name,
            "run": folder.name,
            "config": config,
            "versions": versions,
            "done": done,
            "metrics": read_json(folder / "metrics.json", fix),
            "predictions": [json.loads(line) for line in lines if line.strip()],
        },
        roots,
    )
    write_atomic(path, dump(record))
    return path


def dump(record: dict[str, Any]) -> str:
    """A record as the file holds it: one line per key, one line per answer (readable diffs)."""
    head = ",\n".join(
        f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in record.items() if k != "predictions"
    )
    answers = ",\n".join(json.dumps(p, sort_keys=True) for p in record["predictions"])
    return f'{{{head},\n"predictions": [\n{answers}\n]}}\n'


def read(path: Path) -> dict[str, Any] | None:
    """The record at ``path``; None when there is none.

    Raises:
        KVResearchError: the file is damaged or not a record (it names the file and how to restore it).
    """
    path = Path(path)
    if not path.is_file():
        return None
    fix = (
        f"Restore it (git checkout -- '{path}'), or delete it and rebuild it from its run folder with "
        "make table-<experiment>."
    )
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise KVResearchError(f"The run record {path} is not valid JSON ({error}). {fix}") from error
    missing = [k for k in KEYS if k not in record] if isinstance(record, dict) else list(KEYS)
    if missing or record["format"] != FORMAT:
        raise KVResearchError(f"{path} is not a run record of format {FORMAT} (missing {missing}). {fix}")
    return dict(record)


def done_stamp(folder: Path) -> str | None:
    """The ``DONE`` stamp of the finished run ``folder``, else of its run record, else None.

    A run record stands for a run that finished on another machine.
    """
    try:
        return (Path(folder) / "DONE").read_text(encoding="utf-8").strip()
    except OSError:
        record = read(path_of(records_root(), Path(folder)))
        return None if record is None else str(record["done"])
