"""Run records: a finished run folder as one JSON file in the repository, so a table outlives the machine.

Run folders live under the outputs root, which a fresh clone, a new machine or a cluster's scratch space
does not share. A record (``docs/results/runs/<stage>/<run name>.json``, named like the run folder) holds
what a table and a later run need from it: the resolved config, the versions and commit it ran at, its
``DONE`` stamp, its metrics and its per-answer predictions. ``make table-<name>`` writes the records of the
finished cells it finds and reads a record for any cell whose run folder is not on this machine, so cells
run on different machines (or on a cluster, records committed from there) meet in one table.

A record is written atomically and only from a finished run; one that cannot be read is an error naming
the file, never a cell taken as finished.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from kvresearch.config_check import stored_changes
from kvresearch.errors import KVResearchError
from kvresearch.runs import is_done, read_json, repo_root, today, write_atomic

RECORDS_ENV = "KVRESEARCH_RECORDS"
FORMAT = 1
KEYS = ("format", "stage", "run", "config", "versions", "done", "metrics", "predictions")


def records_root() -> Path:
    """Where run records live: ``$KVRESEARCH_RECORDS``, else ``docs/results/runs/`` in the checkout."""
    return Path(os.environ.get(RECORDS_ENV) or repo_root() / "docs" / "results" / "runs").expanduser()


def path_of(records: Path, folder: Path) -> Path:
    """The record of run ``folder`` (``<outputs>/<stage>/<name>``): ``<records>/<stage>/<name>.json``."""
    folder = Path(folder)
    return Path(records) / folder.parent.name / f"{folder.name}.json"


def write(folder: Path, records: Path) -> Path | None:
    """Record the finished run ``folder`` under ``records``; None when it is not finished.

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
    predictions = folder / "predictions.jsonl"
    lines = predictions.read_text(encoding="utf-8").splitlines() if predictions.is_file() else []
    config = OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"), resolve=False)
    record = {
        "format": FORMAT,
        "stage": folder.parent.name,
        "run": folder.name,
        "config": config,
        "versions": read_json(folder / "versions.json", fix),
        "done": done,
        "metrics": read_json(folder / "metrics.json", fix),
        "predictions": [json.loads(line) for line in lines if line.strip()],
    }
    head = ",\n".join(
        f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in record.items() if k != "predictions"
    )
    answers = ",\n".join(json.dumps(p, sort_keys=True) for p in record["predictions"])
    write_atomic(path, f'{{{head},\n"predictions": [\n{answers}\n]}}\n')  # one line per answer: readable diffs
    return path


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


def record_changes(record: dict[str, Any], stage: str, overrides: list[str]) -> list[str]:
    """What differs between a record's config and the one ``overrides`` compose today (``key: stored -> now``).

    Also each run it read that was redone since, found as a run folder here or as a record (one found nowhere,
    such as a surrogate trained on the machine that ran it, is not checked).
    """
    stored_checkout = str(record["versions"].get("checkout") or repo_root())
    inputs = record["metrics"].get("inputs") or {}
    now = today(stage, overrides)
    return stored_changes(record["config"], stored_checkout, inputs, now, repo_root(), unknown_ok=True)
