"""Experiments: one config per table or figure of the papers (``conf/experiment/<name>.yaml``), as run folders.

An experiment has variants: ``hub`` (the paper's models and grid, for a GPU cluster) and ``twin`` (the same
shape on the embedded model and offline data, sized for 2 CPU cores). A variant lists named ``steps`` (runs
that others hand off to: an extract, a surrogate; each referenced as ``<experiment>:<step>``), models,
overrides shared by every run, and rows (a method with its own overrides, swept over budget points). Every
(model, row, point) is a :class:`Cell` whose run folder is named exactly as Hydra names it from the cell's
overrides, so a table is rebuilt from run folders alone (or, for a cell run on another machine, its run
record, :mod:`kvresearch.runs.records`): a finished cell gives its numbers, any other prints "not run".
``python -m kvresearch.experiment`` runs the missing steps and cells and writes the tables.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from kvresearch.errors import KVResearchError
from kvresearch.runs.naming import CONF_DIR, run_folder
from kvresearch.runs.steps import Step, step_run, steps

__all__ = ["Cell", "Step", "cells", "load", "names", "select", "step_run", "steps", "x_axis"]

EXPERIMENTS = CONF_DIR / "experiment"
KINDS = ("curve", "fit")
RATIOS = ("prune_ratio", "decode_prune_ratio")  # the x-axis: evicted at prefill, or at the end of a generation


def names() -> list[str]:
    """Every experiment config's name."""
    return sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))


def x_axis(exp: DictConfig) -> str:
    """The prune ratio an experiment plots (its ``ratio`` key, one of ``RATIOS``; prefill by default)."""
    return str(exp.get("ratio", RATIOS[0]))


def load(name: str) -> DictConfig:
    """``conf/experiment/<name>.yaml`` (or a YAML file's path), checked: a known kind, ``twin`` and ``hub`` rows."""
    path = Path(name) if name.endswith(".yaml") else EXPERIMENTS / f"{name}.yaml"
    if not path.is_file():
        raise KVResearchError(f"No experiment '{name}' in {EXPERIMENTS}: choose one of {', '.join(names())}.")
    exp = OmegaConf.load(path)
    assert isinstance(exp, DictConfig)
    if exp.get("kind", "curve") not in KINDS:
        raise KVResearchError(f"experiment {name}: kind must be one of {KINDS}, got {exp.get('kind')!r}.")
    if x_axis(exp) not in RATIOS:
        raise KVResearchError(f"experiment {name}: ratio must be one of {RATIOS}, got {exp.get('ratio')!r}.")
    seen: dict[str, str] = {}
    for variant in ("hub", "twin"):
        spec = (exp.get("variants") or {}).get(variant) or {}
        if not spec.get("rows") and not spec.get("steps"):
            raise KVResearchError(f"experiment {name}: variants.{variant} has neither rows nor steps.")
        if spec.get("rows") and not spec.get("models"):
            raise KVResearchError(f"experiment {name}: variants.{variant}.rows need models.")
        for step, body in (spec.get("steps") or {}).items():
            if step in seen:
                raise KVResearchError(f"experiment {name}: step '{step}' is in both {seen[step]} and {variant}.")
            seen[str(step)] = variant
            if not (body or {}).get("stage"):
                raise KVResearchError(
                    f"experiment {name}: step '{step}' needs a stage (extract, train_surrogate, ...)."
                )
    return exp


@dataclass(frozen=True)
class Cell:
    """One run of an experiment: a model, a row (method) and a budget point."""

    stage: str
    model: str
    row: str  # the row's label (its method unless it names one)
    point: str  # the budget point, e.g. "keep_ratio=0.5" ("" for none)
    overrides: tuple[str, ...]
    reference: bool = False  # the full-cache row every other row is paired with

    @property
    def label(self) -> str:
        """``model row point``, for listings."""
        return " ".join(part for part in (self.model, self.row, self.point) if part)

    def folder(self, root: Path) -> Path:
        """The run folder Hydra gives these overrides."""
        return run_folder(root, self.stage, self.overrides)


def cells(exp: DictConfig, variant: str) -> list[Cell]:
    """Every cell of a variant, model by model, rows in their order (each model's full-cache row first)."""
    if variant not in exp.variants:
        raise KVResearchError(f"experiment variants are {sorted(exp.variants)}, not '{variant}'.")
    spec = exp.variants[variant]
    out: list[Cell] = []
    for entry in spec.get("models") or []:  # a config name, or {name, overrides[, label]} (train_surrogate: no model=)
        if isinstance(entry, str):
            model, chosen = entry, [f"model={entry}"]
        else:  # a label tells apart two entries of one model (RULER at 2k and at 4k, each with its own full cache)
            model, chosen = entry.get("label") or entry.name, entry.overrides
        mine: list[Cell] = []
        for row in spec.get("rows") or []:
            sweep = dict(row.get("sweep") or {})
            base = [*chosen, *spec.get("shared", []), *([f"method={row.method}"] if row.get("method") else [])]
            base += list(row.get("overrides") or [])
            for values in itertools.product(*sweep.values()):
                point = [f"{k}={v}" for k, v in zip(sweep, values, strict=True)]
                label = ", ".join(f"{str(k).rsplit('.', 1)[-1]}={v}" for k, v in zip(sweep, values, strict=True))
                overrides = tuple(str(o) for o in [*base, *point])
                cell = Cell(str(exp.get("stage", "evaluate")), str(model), str(row.get("label") or row.method),
                            label, overrides, bool(row.get("reference", False)))  # fmt: skip
                mine.append(cell)
        out += sorted(mine, key=lambda c: not c.reference)
    return out


def select(found: list[Cell], rows: list[str] | None, models: list[str] | None = None) -> list[Cell]:
    """The cells of ``rows`` in that order, each model's full-cache row first; every cell for no ``rows``.

    An entry is a row's label (all its budget points) or ``label@point`` (one point, e.g.
    ``kvzap_mlp@keep_ratio=0.5``), so the key points of a long grid run first and the rest later.
    ``models`` keeps only those model entries (their labels, e.g. ``smollm2_135m 2k``), in the config's order.
    """
    if models:
        entries = list(dict.fromkeys(c.model for c in found))
        unknown = [m for m in models if m not in entries]
        if unknown:
            raise KVResearchError(f"no model {', '.join(unknown)} here; models: {', '.join(entries)}.")
        found = [c for c in found if c.model in models]
    if not rows:
        return found
    known = {c.row for c in found} | {f"{c.row}@{c.point}" for c in found}
    unknown = [r for r in rows if r not in known]
    if unknown:
        points = {
            row: dict.fromkeys(f"@{c.point}" for c in found if c.row == row and c.point)
            for row in dict.fromkeys(c.row for c in found)
        }
        labels = ", ".join(f"{row} ({' '.join(p)})" if p else row for row, p in points.items())
        raise KVResearchError(
            f"no row {', '.join(unknown)} here; rows: {labels}. Give a label (all its points) "
            "or label@point (one point), e.g. kvzap_mlp@keep_ratio=0.5."
        )
    rank = lambda c: min(i for i, r in enumerate(rows) if r in (c.row, f"{c.row}@{c.point}"))
    chosen = [c for c in found if c.reference or c.row in rows or f"{c.row}@{c.point}" in rows]
    order = list(dict.fromkeys(c.model for c in found))
    return sorted(chosen, key=lambda c: (order.index(c.model), not c.reference, 0 if c.reference else rank(c)))
