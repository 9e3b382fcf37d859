"""An experiment's figure, as PNG and PDF.

A metric against the measured prune ratio per model (95% intervals), or held-out R^2 per layer for a fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvresearch.experiment.config import x_axis


def row_color(rows: list[str], row: str) -> str:
    """A row's colour: its place among the figure's ``rows``, so it is the same in every panel."""
    return f"C{rows.index(row) % 10}"


def fit_panel(ax: Any, mine: list[dict[str, Any]], rows: list[str]) -> None:
    """Held-out R^2 per layer, one line per surrogate."""
    for p in mine:
        ax.plot(range(len(p["layers"])), p["layers"], marker="o", label=p["row"], color=row_color(rows, p["row"]))


def curve_panel(ax: Any, mine: list[dict[str, Any]], also: str | None, rows: list[str]) -> float | None:
    """One metric (the main one, or the extra metric ``also``) against the measured prune ratio, per row.

    A row's colour and x offset follow its place among the figure's ``rows`` (compressed rows only), so they
    are the same in every panel, whichever rows a panel lacks.

    When every compressed point sits at one ratio (an ablation table), the rows go side by side on a
    categorical axis instead; returns that shared ratio then (None for a curve).
    """
    value = (lambda p: p["mean"]) if also is None else (lambda p: p["also"][also])
    xs_all = [p["x"] for p in mine if not p.get("reference")]
    single = bool(xs_all) and max(xs_all) - min(xs_all) < 0.005
    step = 0.01 * max(max(xs_all, default=0) - min(xs_all, default=0), 0.1)  # overlapping points stay visible
    names: list[str] = []
    for row in dict.fromkeys(p["row"] for p in mine):
        got = sorted((p for p in mine if p["row"] == row), key=lambda p: p["x"])
        if got[0].get("reference"):  # the full cache: a line with its interval as a band
            m = value(got[0])
            ax.axhline(m.mean, color="black", linestyle="--", linewidth=1, label=row)
            if m.n > 1:
                ax.axhspan(m.low, m.high, color="grey", alpha=0.15)
            continue
        ys = [value(p) for p in got]
        err = [[m.mean - m.low for m in ys], [m.high - m.mean for m in ys]]
        xs = [len(names)] * len(got) if single else [p["x"] + step * (rows.index(row) - 2) for p in got]
        names.append(row)
        label = None if single else row  # side by side, the tick labels name the rows
        ax.errorbar(
            xs,
            [m.mean for m in ys],
            yerr=err if ys[0].n > 1 else None,
            marker="o",
            capsize=3,
            label=label,
            color=row_color(rows, row),
        )
    if not single:
        return None
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    return sum(xs_all) / len(xs_all)


def figure(exp: Any, variant: str, points: list[dict[str, Any]], stem: Path) -> None:
    """The curve or the per-layer fit, as PNG and PDF.

    The curve: metric against measured prune ratio, 95% intervals; one more row of panels per ``also`` metric.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fit = exp.get("kind", "curve") == "fit"
    metric = str(exp.get("metric", "score"))
    shown = [metric] if fit else [metric, *(exp.get("also") or {})]
    models = sorted({p["model"] for p in points}) or ["(no finished run)"]
    size = (max(8, 6 * len(models)), 4.5 * len(shown))
    decoding = x_axis(exp) == "decode_prune_ratio"
    when = "at the end of each generation" if decoding else "at prefill"
    rows = list(dict.fromkeys(p["row"] for p in points if not p.get("reference")))
    fig, axes = plt.subplots(len(shown), len(models), figsize=size, squeeze=False)
    for panels, name in zip(axes, shown, strict=True):
        for ax, model in zip(panels, models, strict=True):
            mine = [p for p in points if p["model"] == model]
            ratio = None
            if fit:
                fit_panel(ax, mine, rows)
                ax.set(xlabel="layer", ylabel="held-out R^2 (pooled per layer)")
            elif (ratio := curve_panel(ax, mine, name if name != metric else None, rows)) is not None:
                ax.set(xlabel=f"method, all at a measured prune ratio of {ratio:.3f} ({when})", ylabel=name)
            else:
                ax.set(xlabel=f"prune ratio (measured share of KV entries evicted {when})", ylabel=name)
            ax.set_title(model, fontsize=9)
            ax.grid(alpha=0.3)
            if mine:
                ax.legend(fontsize=7)
    fig.suptitle(f"{exp.title} ({variant})", fontsize=10)
    fig.tight_layout()
    for suffix in (".png", ".pdf"):
        fig.savefig(stem.with_suffix(suffix), dpi=120)
    plt.close(fig)
