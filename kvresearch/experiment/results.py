"""An experiment's table from its cells' run folders (or run records): statistics per cell, Markdown, LaTeX.

Per cell (``kind: curve``): answers, the measured prune ratio, the mean of ``metric`` with a bootstrap 95%
interval, and the paired difference against the full-cache cell of the same model (the same answers in
both, matched by id) with its interval; answers sharing a context are resampled together.
``kind: fit`` reads train_surrogate runs (held-out R^2).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from kvresearch.experiment.config import Cell, cells, x_axis
from kvresearch.runs import records as run_records
from kvresearch.runs.naming import is_done
from kvresearch.stats import Interval, by_id, context_of

NOT_RUN = "not run"


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

    The run folder under ``root`` comes first; without one, the cell's run record (:mod:`kvresearch.runs.records`).
    Per-answer ``metric`` and ``also`` values come from its answers (predictions, or a fidelity run's generations).
    """
    folder = cell.folder(root)
    record = recorded(cell, root, records)
    if is_done(folder):
        metrics = json.loads((folder / "metrics.json").read_text())
        found = [folder / name for name in run_records.ANSWERS if (folder / name).is_file()]
        lines = found[0].read_text().splitlines() if found else []
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


def per_context(result: Result) -> Result:
    """``result`` with one value per context (the mean of its answers'), for metrics measured once per context."""

    def collapse(values: dict[str, float]) -> dict[str, float]:
        groups: dict[str, list[float]] = {}
        for answer, value in values.items():
            groups.setdefault(context_of(answer), []).append(value)
        return {context: sum(v) / len(v) for context, v in groups.items()}

    return Result(result.metrics, collapse(result.values), {k: collapse(v) for k, v in result.also.items()})


def _interval(i: Interval | None, scale: float, signed: bool = False, digits: int = 1) -> str:
    """``mean [low, high]`` times ``scale``, with ``digits`` decimals.

    The mean alone when there is no interval: one answer, or one context whose answers are resampled together.
    """
    if i is None or i.n == 0:
        return ""
    fmt = f"{'+' if signed else ''}.{digits}f"
    defined = i.n >= 2 and math.isfinite(i.low) and math.isfinite(i.high)
    bounds = f" [{i.low * scale:{fmt}}, {i.high * scale:{fmt}}]" if defined else ""
    return f"{i.mean * scale:{fmt}}{bounds}"


def curve_rows(
    exp: DictConfig, variant: str, root: Path, records: Path | None = None
) -> tuple[list[str], list[list[str]], list[dict[str, Any]]]:
    """Header, table rows and plot points of a ``curve`` experiment (score x100 for 0-1 metrics).

    ``per: context`` takes one value per context (the mean of its answers'): a metric measured once per
    context, such as the seconds to compress it, is not counted once per question.
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
        if result is not None and exp.get("per") == "context":  # one value per context (a timing), not per answer
            result = per_context(result)
        if cell.reference:
            references[cell.model] = result
        if result is None:
            rows.append([cell.model, cell.row, cell.point, *[NOT_RUN] * (len(header) - 3)])
            continue
        reference = references.get(cell.model)
        mean = by_id(result.values)[0]
        calibration = (result.metrics.get("calibration") or {}).get("threshold")
        budget = cell.point + (f" (tau={calibration:.2f})" if calibration is not None else "")
        row = [cell.model, cell.row, budget, str(mean.n), f"{result.ratio(key):.3f}"]
        row.append(_interval(mean, scale, False, digits))
        extra = {name: by_id(result.also[name])[0] for name in also}
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
                row.append(_interval(by_id(values, theirs)[1], factor, True, places) or "no full run")
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
