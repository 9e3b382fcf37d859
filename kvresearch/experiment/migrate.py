"""``python -m kvresearch.experiment migrate``: run folders and run records under today's option names.

The renames themselves are pure (:mod:`kvresearch.runs.migrate`); here they are applied to files. A run
folder is renamed from its Hydra overrides (``.hydra/overrides.yaml``); a run record, whose name may be cut
short with a hash, is found from the experiments' cells (each cell's overrides before the renames). Every
record's config is rewritten in today's layout and names the renames applied (``migrated``); its commit,
``DONE`` stamp, metrics and answers stay as they were. A name already taken is left alone and reported.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from omegaconf import OmegaConf

from kvresearch import experiment as experiments
from kvresearch.runs import migrate, write_atomic
from kvresearch.runs import records as run_records
from kvresearch.runs.naming import run_folder


def folders(root: Path, dry_run: bool = False) -> Iterator[str]:
    """Rename every run folder under ``root`` whose overrides hold a renamed option; one line per change."""
    for stored in sorted(Path(root).glob("*/*/.hydra/overrides.yaml")):
        folder = stored.parent.parent
        old = [str(o) for o in OmegaConf.load(stored)]
        new = migrate.overrides(old)
        target = run_folder(root, folder.parent.name, new)
        if target == folder:
            continue
        if target.exists():
            yield f"left {folder.name}: {target.name} exists already"
            continue
        yield f"run folder {folder.parent.name}/{folder.name} -> {target.name}"
        if not dry_run:
            write_atomic(stored, OmegaConf.to_yaml(OmegaConf.create(new)))
            config = OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"), resolve=False)
            assert isinstance(config, dict)
            write_atomic(
                folder / "config.yaml", OmegaConf.to_yaml(migrate.config({str(k): v for k, v in config.items()})[0])
            )
            folder.rename(target)


def record_renames(records: Path) -> dict[Path, Path]:
    """Old record path -> new, for every experiment cell whose record is stored under its old overrides."""
    found: dict[Path, Path] = {}
    for name in experiments.names():
        exp = experiments.load(name)
        for variant in exp.variants:
            for cell in experiments.cells(exp, str(variant)):
                new = run_records.path_of(records, cell.folder(Path("/")))
                old = run_records.path_of(records, run_folder(Path("/"), cell.stage, migrate.backward(cell.overrides)))
                if old != new and old.is_file():
                    found[old] = new
    return found


def records(records: Path, dry_run: bool = False) -> Iterator[str]:
    """Rename the records of renamed cells; rewrite every record's config in today's layout."""
    renames = record_renames(records)
    for path in sorted(Path(records).glob("*/*.json")):
        record = run_records.read(path)
        assert record is not None
        record["config"], applied = migrate.config(record["config"])
        target = renames.get(path, path)
        if not applied and target == path:
            continue
        if target != path and target.exists():
            yield f"left {path.name}: {target.name} exists already"
            continue
        record["run"] = target.stem
        record["migrated"] = sorted(set(record.get("migrated", [])) | set(applied))
        yield f"record {path.parent.name}/{path.name}" + (f" -> {target.name}" if target != path else "")
        if not dry_run:
            write_atomic(target, run_records.dump(record))
            if target != path:
                path.unlink()


def run(root: Path, records_root: Path, dry_run: bool = False) -> Iterator[str]:
    """Migrate the run folders of ``root`` and the records of ``records_root``."""
    yield from folders(root, dry_run)
    yield from records(records_root, dry_run)
