"""Experiment tracking: ``logger=none`` or ``logger=wandb`` (offline unless WANDB_MODE says otherwise).

Local files in the run folder are the record; W&B mirrors them. One W&B run per job, always
finished in ``finally``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Tracker:
    """The no-op tracker (``logger=none``); also the interface of the W&B one."""

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Time series: ``metrics`` at ``step``."""

    def summary(self, metrics: Mapping[str, Any]) -> None:
        """Final numbers of the run."""

    def table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A table (predictions, a results summary)."""

    def image(self, name: str, path: Path) -> None:
        """A figure from an image file."""

    def finish(self, exit_code: int = 0) -> None:
        """Close the run."""


def _scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts to ``a/b`` keys, keeping numbers, strings and booleans."""
    flat: dict[str, Any] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_scalars(value, f"{name}/"))
        elif isinstance(value, (int, float, str, bool)):
            flat[name] = value
    return flat


class WandbTracker(Tracker):
    """One W&B run per job (offline unless WANDB_MODE says otherwise)."""

    def __init__(self, cfg: Mapping[str, Any], run_config: dict[str, Any], out_dir: Path, name: str, job_type: str):
        import wandb

        os.environ.setdefault("WANDB_MODE", str(cfg.get("mode") or "offline"))
        self.run = wandb.init(
            project=cfg.get("project"),
            entity=cfg.get("entity"),
            group=cfg.get("group"),
            tags=list(cfg.get("tags") or []),
            name=name,
            job_type=job_type,
            dir=str(out_dir),
            config=run_config,
            reinit="finish_previous",
        )

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log scalars at ``step``."""
        self.run.log(_scalars(metrics), step=step)

    def summary(self, metrics: Mapping[str, Any]) -> None:
        """Set the run's summary."""
        self.run.summary.update(_scalars(metrics))

    def table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Log a W&B Table (cells that are not numbers or strings become strings)."""
        import wandb

        plain = [[c if isinstance(c, (int, float, str, bool)) or c is None else str(c) for c in r] for r in rows]
        self.run.log({name: wandb.Table(columns=list(columns), data=plain)})

    def image(self, name: str, path: Path) -> None:
        """Log an image file as a W&B Image."""
        import wandb

        self.run.log({name: wandb.Image(str(path))})

    def finish(self, exit_code: int = 0) -> None:
        """Close the run and wait until its records are on disk.

        ``run.finish`` can return before the W&B service has written the run's records (seen on a loaded machine:
        the offline ``.wandb`` file held only its header); ``teardown`` waits for the service to write everything
        and exit, so the run folder is complete before the stage marks the run done. The next run starts a new
        service.
        """
        import wandb

        self.run.finish(exit_code=exit_code)
        wandb.teardown()


@contextmanager
def tracker(
    cfg: Mapping[str, Any] | None, run_config: dict[str, Any], out_dir: Path, name: str, job_type: str
) -> Iterator[Tracker]:
    """The tracker named by ``cfg['kind']`` ('none' or 'wandb'), finished when the block exits."""
    kind = (cfg or {}).get("kind", "none")
    if kind == "none":
        yield Tracker()
        return
    if kind != "wandb":
        raise ValueError(f"logger.kind must be 'none' or 'wandb', got {kind!r}")
    active = WandbTracker(cfg or {}, run_config, out_dir, name, job_type)
    exit_code = 1
    try:
        yield active
        exit_code = 0
    finally:
        active.finish(exit_code)
