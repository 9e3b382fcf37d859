"""Experiments: one config per table or figure of the papers (``conf/experiment/<name>.yaml``), as run folders.

An experiment has variants: ``hub`` (the paper's models and grid, for a GPU cluster) and ``twin`` (the same
shape on the embedded model and offline data, sized for 2 CPU cores). A variant lists models, overrides
shared by every run, and rows (a method with its own overrides, swept over budget points). Every
(model, row, point) is a :class:`Cell` whose run folder is named exactly as Hydra names it from the
cell's overrides, so a table is rebuilt from run folders alone (or, for a cell run on another machine,
its run record, :mod:`kvresearch.records`): a finished cell gives its numbers, any other prints "not run".
``scripts/experiment.py`` runs the missing cells and writes the tables.

Statistics per cell (``kind: curve``): answers, the measured prune ratio, the mean of ``metric`` with a
bootstrap 95% interval, and the paired difference against the full-cache cell of the same model (the
same answers in both) with its interval. ``kind: fit`` reads train_surrogate runs (held-out R^2).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvresearch import records as run_records
from kvresearch.errors import KVResearchError
from kvresearch.runs import CONF_DIR, is_done, run_name
from kvresearch.stats import Interval, bootstrap_mean, paired_difference

EXPERIMENTS = CONF_DIR / "experiment"
NOT_RUN = "not run"
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
    for variant in ("hub", "twin"):
        if not (exp.get("variants") or {}).get(variant, {}).get("rows"):
            raise KVResearchError(f"experiment {name}: variants.{variant}.rows is missing or empty.")
    return exp


@functools.cache
def excluded_keys() -> frozenset[str]:
    """The override keys Hydra leaves out of run names (``conf/common.yaml``, read once)."""
    common = OmegaConf.load(CONF_DIR / "common.yaml")
    return frozenset(common.hydra.job.config.override_dirname.exclude_keys)


def run_folder(root: Path, stage: str, overrides: Sequence[str]) -> Path:
    """The run folder Hydra gives ``overrides`` of ``stage`` (``conf/common.yaml``: sorted, excluded keys left out)."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in excluded_keys()]
    return Path(root) / stage / run_name(",".join(sorted(kept)))


@dataclass(frozen=True)
class Cell:
    """One run of an experiment: a model, a row (method) and a budget point."""

    stage: str
    model: str
    row: str  # the row's label (its method unless it names one)
    point: str  # the budget point, e.g. "calibrate_to=0.5" ("" for none)
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
    for entry in spec.models:  # a model config name, or {name, overrides[, label]} (train_surrogate takes no model=)
        if isinstance(entry, str):
            model, chosen = entry, [f"model={entry}"]
        else:  # a label tells apart two entries of one model (RULER at 2k and at 4k, each with its own full cache)
            model, chosen = entry.get("label") or entry.name, entry.overrides
        mine: list[Cell] = []
        for row in spec.rows:
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
    ``kvzap_mlp@calibrate_to=0.5``), so the key points of a long grid run first and the rest later.
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
            "or label@point (one point), e.g. kvzap_mlp@calibrate_to=0.5."
        )
    rank = lambda c: min(i for i, r in enumerate(rows) if r in (c.row, f"{c.row}@{c.point}"))
    chosen = [c for c in found if c.reference or c.row in rows or f"{c.row}@{c.point}" in rows]
    order = list(dict.fromkeys(c.model for c in found))
    return sorted(chosen, key=lambda c: (order.index(c.model), not c.reference, 0 if c.reference else rank(c)))


@dataclass
class Result:
    """What a finished cell's run folder, or its run record, gives."""

    metrics: dict[str, Any]
    values: dict[str, float] = field(default_factory=dict)  # per answer id: the metric
    also: dict[str, dict[str, float]] = field(default_factory=dict)  # per extra metric: per answer id, its value

    def ratio(self, key: str) -> float:
        """The measured prune ratio ``key`` (one of ``RATIOS``; mean over answers)."""
        return float(self.metrics.get("overall", {}).get(key) or 0.0)


def recorded(cell: Cell, root: Path, records: Path | None) -> dict[str, Any] | None:
    """The run record of ``cell`` when it has no finished run folder under ``root``; else None."""
    if records is None or is_done(cell.folder(root)):
        return None
    return run_records.read(run_records.path_of(records, cell.folder(root)))


def read(cell: Cell, root: Path, metric: str, also: tuple[str, ...] = (), records: Path | None = None) -> Result | None:
    """The finished run of ``cell``, or None (no finished folder, and no record of one under ``records``).

    The run folder under ``root`` comes first; without one, the cell's run record (:mod:`kvresearch.records`).
    Per-answer ``metric`` and ``also`` values come from its predictions.
    """
    folder = cell.folder(root)
    record = recorded(cell, root, records)
    if is_done(folder):
        metrics = json.loads((folder / "metrics.json").read_text())
        predictions = folder / "predictions.jsonl"
        lines = predictions.read_text().splitlines() if predictions.is_file() else []
        answers = [json.loads(line) for line in lines if line.strip()]
    elif record is not None:
        metrics, answers = record["metrics"], record["predictions"]
    else:
        return None
    per: dict[str, dict[str, float]] = {name: {} for name in (metric, *also)}
    for answer in answers:
        for name, values in per.items():
            if answer.get(name) is not None and math.isfinite(float(answer[name])):  # NaN: an empty answer
                values[str(answer["id"])] = float(answer[name])
    return Result(metrics, per[metric], {name: per[name] for name in also})


def paired(values: dict[str, float], reference: dict[str, float] | None) -> Interval | None:
    """Per-answer ``values`` minus the reference's over the answers both have, with its bootstrap interval."""
    if reference is None:
        return None
    ids = sorted(set(values) & set(reference))
    return paired_difference([values[i] for i in ids], [reference[i] for i in ids]) if ids else None


def _interval(i: Interval | None, scale: float, signed: bool = False, digits: int = 1) -> str:
    """``mean [low, high]`` times ``scale``, with ``digits`` decimals."""
    if i is None or i.n == 0:
        return ""
    fmt = f"{'+' if signed else ''}.{digits}f"
    bounds = "" if i.n < 2 else f" [{i.low * scale:{fmt}}, {i.high * scale:{fmt}}]"
    return f"{i.mean * scale:{fmt}}{bounds}"


def curve_rows(
    exp: DictConfig, variant: str, root: Path, records: Path | None = None
) -> tuple[list[str], list[list[str]], list[dict[str, Any]]]:
    """Header, table rows and plot points of a ``curve`` experiment (score x100 for 0-1 metrics).

    ``also: {name: {scale, digits}}`` adds two columns per extra per-answer metric (its mean, and its paired
    difference against the full cache), e.g. agreement with the full cache's answer and the NLL of that
    answer, which separate methods where the score sits at chance (defaults: scale 1, 3 decimals).
    """
    metric = str(exp.get("metric", "score"))
    shown = {metric: (float(exp.get("scale", 100)), int(exp.get("digits", 1)))}  # name: (scale, decimals)
    for name, spec in (exp.get("also") or {}).items():
        shown[str(name)] = (float((spec or {}).get("scale", 1)), int((spec or {}).get("digits", 3)))
    also = [name for name in shown if name != metric]
    scale, digits = shown[metric]
    key = x_axis(exp)
    header = ["model", "method", "budget", "answers", key.replace("_", " "), f"{metric} [95% CI]", "vs full [95% CI]"]
    header += [c for name in also for c in (f"{name} [95% CI]", f"{name} vs full")]
    rows, points = [], []
    references: dict[str, Result | None] = {}
    for cell in cells(exp, variant):
        result = read(cell, root, metric, tuple(also), records)
        if cell.reference:
            references[cell.model] = result
        if result is None:
            rows.append([cell.model, cell.row, cell.point, *[NOT_RUN] * (len(header) - 3)])
            continue
        reference = references.get(cell.model)
        mean = bootstrap_mean(list(result.values.values()))
        calibration = (result.metrics.get("calibration") or {}).get("threshold")
        budget = cell.point + (f" (tau={calibration:.2f})" if calibration is not None else "")
        row = [cell.model, cell.row, budget, str(mean.n), f"{result.ratio(key):.3f}"]
        row.append(_interval(mean, scale, False, digits))
        extra = {name: bootstrap_mean(list(result.also[name].values())) for name in also}
        for name, (factor, places) in shown.items():
            values = result.values if name == metric else result.also[name]
            if name != metric:
                row.append(_interval(extra[name], factor, False, places))
            if cell.reference:
                row.append("")
            elif reference is None:
                row.append("no full run")
            else:
                theirs = reference.values if name == metric else reference.also[name]
                row.append(_interval(paired(values, theirs), factor, True, places) or "no full run")
        rows.append(row)
        extra = {name: i.scaled(shown[name][0]) for name, i in extra.items()}
        points.append({"model": cell.model, "row": cell.row, "x": result.ratio(key), "mean": mean.scaled(scale),
                       "also": extra, "reference": cell.reference})  # fmt: skip
    return header, rows, points


def fit_rows(
    exp: DictConfig, variant: str, root: Path, records: Path | None = None
) -> tuple[list[str], list[list[str]], list[dict[str, Any]]]:
    """Header, table rows and per-layer points of a ``fit`` experiment (train_surrogate runs)."""
    header = ["model", "surrogate", "setting", "test rows", "R^2 pooled", "R^2 pooled per layer", "R^2 per head",
              "Spearman"]  # fmt: skip
    rows, points = [], []
    for cell in cells(exp, variant):
        result = read(cell, root, "", (), records)
        if result is None:
            rows.append([cell.model, cell.row, cell.point, *[NOT_RUN] * 5])
            continue
        t = result.metrics["test"]
        per_layer = sum(t["r2_per_layer"]) / len(t["r2_per_layer"])  # mean over layers of each layer's pooled R^2
        rows.append([cell.model, cell.row, cell.point, str(t["rows"]), f"{t['r2_pooled']:.3f}", f"{per_layer:.3f}",
                     f"{t['r2_mean']:.3f}", f"{t['spearman_mean']:.3f}"])  # fmt: skip
        points.append({"model": cell.model, "row": f"{cell.row} {cell.point}".strip(), "layers": t["r2_per_layer"]})
    return header, rows, points


def table(
    exp: DictConfig, variant: str, root: Path, records: Path | None = None
) -> tuple[list[str], list[list[str]], list[dict[str, Any]]]:
    """The experiment's table for its kind.

    From the run folders under ``root`` and, for cells without one there, the run records under ``records``
    (None: run folders only).
    """
    return (fit_rows if exp.get("kind", "curve") == "fit" else curve_rows)(exp, variant, root, records)


def markdown(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)]) + "\n"


def latex(header: list[str], rows: list[list[str]], caption: str) -> str:
    """A LaTeX tabular in a table environment (booktabs rules)."""
    esc = lambda s: s.replace("\\", "\\textbackslash{}").replace("_", "\\_").replace("%", "\\%").replace("&", "\\&")
    body = [" & ".join(esc(c) for c in r) + " \\\\" for r in rows]
    return "\n".join([
        "\\begin{table}[t]", "\\centering", "\\small", "\\begin{tabular}{" + "l" * len(header) + "}", "\\toprule",
        " & ".join(esc(h) for h in header) + " \\\\", "\\midrule", *body, "\\bottomrule", "\\end{tabular}",
        f"\\caption{{{esc(caption)}}}", "\\end{table}",
    ]) + "\n"  # fmt: skip


def summary_line(rows: list[list[str]]) -> str:
    """How many cells are finished."""
    done = sum(r[3] != NOT_RUN for r in rows)
    return f"{done} of {len(rows)} cells finished"
