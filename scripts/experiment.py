"""Run an experiment's missing cells, or rebuild its table and figure from the run folders (conf/experiment/).

    .venv/bin/python scripts/experiment.py list
    .venv/bin/python scripts/experiment.py run kvzap_ruler [--variant twin|hub] [--rows R,..] [--models M,..] [--print]
        [--launcher slurm] [--on-config-change refuse|redo|keep] [--skip-recorded] [-- ARGS]
    .venv/bin/python scripts/experiment.py table kvzap_ruler [--variant twin] [--out docs/results/experiments] [--wandb]
        [--records docs/results/runs] [--no-record]

``run`` starts one stage job per cell that is not finished (the full-cache row first: the others take their
full-cache answers from it; ``--rows`` picks rows or budget points, in the order given; ``--models`` model
entries), each logged to W&B (offline by default; ``--no-wandb`` to skip) in the group ``<experiment>`` with
the variant as a tag;
``--print`` only prints the commands (to hand to any scheduler);
``--launcher NAME`` submits each cell through ``hydra/launcher=NAME`` (conf/hydra/launcher/);
``--on-config-change`` says what to do with cells whose run folder was made with other settings than
today's config (stop and list them, redo them, or keep them); ``--skip-recorded`` leaves the cells that
have a run record from another machine. Extra
arguments after ``--`` go to every job. ``table`` records the finished cells found under the outputs root
(``docs/results/runs/``, kvresearch/records.py), then writes ``<out>/<name>_<variant>.md`` and ``.tex`` (a
cell without a finished run folder here or a run record prints "not run"; one that today's config would not
compute as it is is marked "(changed)", with what differs under the table; cells read from records are
listed under it) and ``.png`` / ``.pdf`` (the curve: metric against the
measured prune ratio with 95% intervals; the fit: held-out R^2 per layer) and one W&B run in the
experiment's group holding the table (a W&B Table) and the figure (``--no-wandb`` to skip).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvresearch import experiments, runs
from kvresearch import records as run_records
from kvresearch.errors import KVResearchError
from kvresearch.runs import is_done, outputs_root, repo_root, write_atomic


def command(cell: experiments.Cell, exp_name: str, args: argparse.Namespace, extra: tuple[str, ...] = ()) -> list[str]:
    """The stage command of one cell (``extra``: overrides for this cell alone)."""
    cmd = [sys.executable, "-m", f"kvresearch.stages.{cell.stage}", *cell.overrides, *extra]
    cmd += ["logger=wandb", f"logger.group={exp_name}", f"logger.tags=[{args.variant}]"] if args.wandb else []
    cmd += ["-m", f"hydra/launcher={args.launcher}"] if args.launcher else []
    return cmd + list(args.extra)


def changed_cells(cells: list[experiments.Cell], root: Path, extra: list[str]) -> dict[experiments.Cell, list[str]]:
    """The cells whose run folder (finished or not) was made with other settings than today's config gives, or
    from runs redone since; for each, what differs."""
    found = {c: runs.folder_changes(c.folder(root), c.stage, [*c.overrides, *extra]) for c in cells}
    return {c: changes for c, changes in found.items() if changes}


def run(args: argparse.Namespace) -> None:
    exp = experiments.load(args.name)
    root = outputs_root()
    split = lambda arg: arg.split(",") if arg else None
    chosen = experiments.select(experiments.cells(exp, args.variant), split(args.rows), split(args.models))
    changed = changed_cells(chosen, root, args.extra)
    if changed and args.on_config_change == "refuse":
        listing = "\n".join(f"  {c.label}: {'; '.join(found[:3])}" for c, found in changed.items())
        raise SystemExit(
            f"{len(changed)} cells of {args.name} have run folders made with other settings than today's config, "
            f"or from runs redone since (stored -> now):\n{listing}\nRedo them with --on-config-change redo "
            "(their folders are emptied), or keep them as they are with --on-config-change keep."
        )
    per_cell = {c: ("force=true" if args.on_config_change == "redo" else "on_config_change=keep",) for c in changed}
    redo = args.on_config_change == "redo"
    todo = [c for c in chosen if not is_done(c.folder(root)) or (redo and c in changed)]
    recorded = [c for c in todo if experiments.recorded(c, root, run_records.records_root()) is not None]
    todo = [c for c in todo if c not in recorded] if args.skip_recorded else todo
    print(f"{args.name} ({args.variant}): {len(todo)} cells to run", flush=True)
    if recorded and not args.skip_recorded:
        print(f"{len(recorded)} of these cells have run records from another machine (--skip-recorded leaves them)")
    failed = []
    for i, cell in enumerate(todo, 1):
        cmd = command(cell, Path(args.name).stem, args, per_cell.get(cell, ()))
        print(f"[{i}/{len(todo)}] {shlex.join(cmd[1:])}", flush=True)
        if not args.print and subprocess.run(cmd, cwd=repo_root()).returncode != 0:
            failed.append(cell)
    if failed:
        listing = "; ".join(c.label for c in failed)
        raise SystemExit(f"{len(failed)} cells failed ({listing}); fix and re-run: finished cells are skipped.")


def row_color(rows: list[str], row: str) -> str:
    """A row's colour: its place among the figure's ``rows``, so it is the same in every panel."""
    return f"C{rows.index(row) % 10}"


def fit_panel(ax: Any, mine: list[dict[str, Any]], rows: list[str]) -> None:
    """Held-out R^2 per layer, one line per surrogate."""
    for p in mine:
        ax.plot(range(len(p["layers"])), p["layers"], marker="o", label=p["row"], color=row_color(rows, p["row"]))


def curve_panel(ax: Any, mine: list[dict[str, Any]], also: str | None, rows: list[str]) -> float | None:
    """One metric (the main one, or the extra metric ``also``) against the measured prune ratio, per row;
    a row's colour and x offset follow its place among the figure's ``rows`` (compressed rows only), so they
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
    """The curve (metric against measured prune ratio, 95% intervals; one more row of panels per ``also``
    metric) or the per-layer fit, as PNG and PDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fit = exp.get("kind", "curve") == "fit"
    metric = str(exp.get("metric", "score"))
    shown = [metric] if fit else [metric, *(exp.get("also") or {})]
    models = sorted({p["model"] for p in points}) or ["(no finished run)"]
    size = (max(8, 6 * len(models)), 4.5 * len(shown))
    decoding = experiments.x_axis(exp) == "decode_prune_ratio"
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


def mark_changed(exp: Any, variant: str, root: Path, records: Path, rows: list[list[str]], name: str) -> str:
    """Mark the rows of finished cells (run folders here, or run records) that today's config would not compute
    as they are ("(changed)" after the method) and return the note that lists them ("" when there are none)."""
    every = experiments.cells(exp, variant)
    here = [c for c in every if is_done(c.folder(root))]
    changed = changed_cells(here, root, [f"paths.root={root}"])
    for cell in every:
        record = experiments.recorded(cell, root, records)
        found = record and run_records.record_changes(record, cell.stage, [*cell.overrides, f"paths.root={root}"])
        if found:
            changed[cell] = found
    for row, cell in zip(rows, every, strict=True):
        if cell in changed:
            row[1] += " (changed)"
    if not changed:
        return ""
    lines = "\n".join(f"- {c.label}: {'; '.join(found[:3])}" for c, found in changed.items())
    return (
        "\nCells marked (changed) were run with other settings, or from runs redone since, than today's config "
        f'gives (stored -> now); `make experiment-{name} EXP_ARGS="--on-config-change redo"` reruns them:\n'
        f"{lines}\n"
    )


def recorded_note(exp: Any, variant: str, root: Path, records: Path) -> str:
    """The cells read from run records, not from run folders here: where and when each ran ("" for none)."""
    lines = []
    for cell in experiments.cells(exp, variant):
        if (record := experiments.recorded(cell, root, records)) is not None:
            git = record["versions"].get("git") or {}
            commit = (git.get("commit") or "unknown")[:7] + (" (uncommitted changes)" if git.get("dirty") else "")
            lines.append(f"- {cell.label}: finished {record['done'][:16]}, commit {commit}")
    if not lines:
        return ""
    shown = records.relative_to(repo_root()) if records.is_relative_to(repo_root()) else records
    listing = "\n".join(lines)
    return f"\nCells read from run records ({shown}/; their run folders are not on this machine):\n{listing}\n"


def table(args: argparse.Namespace) -> None:
    exp = experiments.load(args.name)
    root, records = Path(args.root), Path(args.records)
    if args.record:  # the finished cells here, kept in the repository beside the table they make
        written = [run_records.write(c.folder(root), records) for c in experiments.cells(exp, args.variant)]
        print(f"{sum(p is not None for p in written)} finished cells recorded under {records}")
    header, rows, points = experiments.table(exp, args.variant, root, records)
    name = Path(args.name).stem  # a config's name, or a YAML file's
    changed = mark_changed(exp, args.variant, root, records, rows, name)
    out = Path(args.out)
    stem = out / f"{name}_{args.variant}"
    caption = f"{exp.title} ({args.variant}; mirrors {exp.paper}). {experiments.summary_line(rows)}."
    text = f"# {exp.title} ({args.variant})\n\nMirrors {exp.paper}. {exp.get('notes', '')}\n\n"
    text += experiments.markdown(header, rows) + f"\n{experiments.summary_line(rows)}; 95% bootstrap intervals.\n"
    text += changed + recorded_note(exp, args.variant, root, records)
    write_atomic(stem.with_suffix(".md"), text)
    write_atomic(stem.with_suffix(".tex"), experiments.latex(header, rows, caption))
    figure(exp, args.variant, points, stem)
    print(text)
    print(f"wrote {stem}.md, .tex, .png and .pdf")
    if args.wandb:
        from kvresearch.tracking import tracker

        config = {"experiment": args.name, "variant": args.variant}
        logs = Path(args.root) / "tables" / stem.name  # W&B's files stay out of docs/
        logs.mkdir(parents=True, exist_ok=True)
        with tracker({"kind": "wandb", "mode": "offline", "project": "kvresearch", "group": args.name},
                     config, logs, f"{args.name}-{args.variant}-table", "table") as t:  # fmt: skip
            t.table("summary", header, rows)
            t.image("figure", stem.with_suffix(".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="the experiments and their cell counts")
    for action in ("run", "table"):
        p = sub.add_parser(action)
        p.add_argument("name")
        p.add_argument("--variant", default="twin", choices=["twin", "hub"])
        p.add_argument("--wandb", action=argparse.BooleanOptionalAction, default=True,
                       help="log to W&B, grouped per experiment (offline unless WANDB_MODE=online)")  # fmt: skip
    runner, tables = sub.choices["run"], sub.choices["table"]
    runner.add_argument("--print", action="store_true", help="print the commands of the missing cells only")
    only = "only these rows, in this order (label or label@point, comma-separated; the full cache runs first)"
    runner.add_argument("--rows", default=None, help=f"{only}, e.g. kvzap_mlp@calibrate_to=0.5,kvzip_plus")
    runner.add_argument("--models", default=None, help="only these model entries (labels, comma-separated)")
    runner.add_argument("--launcher", default=None, help="hydra/launcher for every cell (slurm, local, joblib)")
    runner.add_argument(
        "--on-config-change",
        default="refuse",
        choices=["refuse", "redo", "keep"],
        help="cells whose run folder was made with other settings: stop and list them (refuse), "
        "empty and run them again (redo), or keep them as they are (keep)",
    )
    runner.add_argument(
        "--skip-recorded",
        action="store_true",
        help="leave the cells that have a run record (finished on another machine) and no run folder here",
    )
    runner.add_argument("extra", nargs="*", help="after --: overrides for every job")
    tables.add_argument("--root", default=str(outputs_root()))
    tables.add_argument("--out", default="docs/results/experiments")
    records = "run records: read for cells with no run folder here, written for finished ones"
    tables.add_argument("--records", default=str(run_records.records_root()), help=records)
    write = "record the finished cells found under --root (--no-record: only read the records)"
    tables.add_argument("--record", action=argparse.BooleanOptionalAction, default=True, help=write)
    args = parser.parse_args()
    try:
        if args.action == "list":
            for name in experiments.names():
                exp = experiments.load(name)
                sizes = {v: len(experiments.cells(exp, v)) for v in ("twin", "hub")}
                print(f"{name:24s} twin {sizes['twin']:3d} cells, hub {sizes['hub']:4d} cells  {exp.title}")
        else:
            (run if args.action == "run" else table)(args)
    except KVResearchError as error:
        raise SystemExit(str(error)) from error


if __name__ == "__main__":
    main()
