"""``python -m kvresearch.experiment list|run|table``: an experiment's steps and missing cells, its table.

    python -m kvresearch.experiment list
    python -m kvresearch.experiment index          # docs/results/README.md
    python -m kvresearch.experiment migrate [--dry-run]   # run folders and records under renamed options
    python -m kvresearch.experiment run kvzap_ruler [--variant twin|hub] [--rows R,..] [--models M,..] [--print]
        [--launcher slurm] [--on-config-change refuse|redo|keep] [--skip-recorded] [-- ARGS]
    python -m kvresearch.experiment table kvzap_ruler [--variant twin] [--out docs/results/experiments]
        [--records docs/results/runs] [--no-record] [--no-wandb]

``run`` starts one stage job per step, then per cell, that is not finished (steps in their order; each
model's full-cache row first: the others take their full-cache answers from it; ``--rows`` picks rows or
budget points, in the order given; ``--models`` model entries), each logged to W&B (offline by default) in
the group ``<experiment>`` with the variant as a tag. ``--print`` only prints the commands (for any
scheduler); ``--launcher NAME`` submits each through ``hydra/launcher=NAME``; ``--on-config-change`` says
what to do with runs whose folder was made with other settings than today's config (stop and list them,
redo them, or keep them); ``--skip-recorded`` leaves the cells that have a run record from another
machine. Arguments after ``--`` go to every job.

``table`` records the finished cells found under the outputs root (``docs/results/runs/``, only runs made
at a clean commit), then writes ``<out>/<name>_<variant>.md``, ``.tex``, ``.png`` and ``.pdf``: a cell
without a finished run folder here or a run record prints "not run"; one today's config would not compute
as it is is marked "(changed)"; cells read from records are listed under the table.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvresearch import experiment as experiments
from kvresearch.errors import KVResearchError
from kvresearch.experiment import index, migrate
from kvresearch.experiment.figures import figure
from kvresearch.runs import is_done, outputs_root, repo_root, write_atomic
from kvresearch.runs import records as run_records
from kvresearch.runs.changes import folder_changes, record_changes

Run = experiments.Cell | experiments.Step


def command(
    stage: str, overrides: Sequence[str], name: str, args: argparse.Namespace, extra: Sequence[str] = ()
) -> list[str]:
    """The stage command of one step or cell (``extra``: overrides for it alone)."""
    cmd = [sys.executable, "-m", f"kvresearch.stages.{stage}", *overrides, *extra]
    cmd += ["logger=wandb", f"logger.group={name}", f"logger.tags=[{args.variant}]"] if args.wandb else []
    cmd += ["-m", f"hydra/launcher={args.launcher}"] if args.launcher else []
    return cmd + list(args.extra)


def changed_runs(chosen: Sequence[Run], root: Path, extra: list[str]) -> dict[Run, list[str]]:
    """The steps or cells whose run folder was made with other settings than today's, or from runs redone since.

    Returns each with what differs.
    """
    found = {c: folder_changes(c.folder(root), c.stage, [*c.overrides, *extra]) for c in chosen}
    return {c: changes for c, changes in found.items() if changes}


def label(item: Run) -> str:
    """How a listing names a step or a cell."""
    return f"step {item.name}" if isinstance(item, experiments.Step) else item.label


def run(args: argparse.Namespace) -> None:
    """Start the missing steps and cells of one experiment's variant."""
    exp = experiments.load(args.name)
    name = Path(args.name).stem
    root = outputs_root()
    split = lambda arg: arg.split(",") if arg else None
    chosen: list[Run] = [*experiments.steps(exp, args.variant)]
    chosen += experiments.select(experiments.cells(exp, args.variant), split(args.rows), split(args.models))
    changed = changed_runs(chosen, root, args.extra)
    if changed and args.on_config_change == "refuse":
        listing = "\n".join(f"  {label(c)}: {'; '.join(found[:3])}" for c, found in changed.items())
        raise SystemExit(
            f"{len(changed)} runs of {name} have folders made with other settings than today's config, "
            f"or from runs redone since (stored -> now):\n{listing}\nRedo them with --on-config-change redo "
            "(their folders are emptied), or keep them as they are with --on-config-change keep."
        )
    per_run = {c: ("force=true" if args.on_config_change == "redo" else "on_config_change=keep",) for c in changed}
    redo = args.on_config_change == "redo"
    todo = [c for c in chosen if not is_done(c.folder(root)) or (redo and c in changed)]
    cells = [c for c in todo if isinstance(c, experiments.Cell)]
    recorded = [c for c in cells if experiments.recorded(c, root, run_records.records_root()) is not None]
    todo = [c for c in todo if c not in recorded] if args.skip_recorded else todo
    print(f"{name} ({args.variant}): {len(todo)} runs to start", flush=True)
    if recorded and not args.skip_recorded:
        print(f"{len(recorded)} of these cells have run records from another machine (--skip-recorded leaves them)")
    failed = []
    for i, item in enumerate(todo, 1):
        cmd = command(item.stage, item.overrides, name, args, per_run.get(item, ()))
        print(f"[{i}/{len(todo)}] {shlex.join(cmd[1:])}", flush=True)
        if args.print:
            continue
        if subprocess.run(cmd, cwd=repo_root()).returncode != 0:
            failed.append(item)
            if isinstance(item, experiments.Step):  # later runs read it
                break
    if failed:
        listing = "; ".join(label(c) for c in failed)
        raise SystemExit(f"{len(failed)} runs failed ({listing}); fix and re-run: finished runs are skipped.")
    for report in exp.variants[args.variant].get("reports") or []:  # tables built from the finished runs
        cmd = [sys.executable, "-m", *(str(part) for part in report)]
        print(f"[report] {shlex.join(cmd[1:])}", flush=True)
        if not args.print and subprocess.run(cmd, cwd=repo_root()).returncode != 0:
            raise SystemExit(f"The report {report[0]} failed; its runs are finished: rerun it alone with that command.")


def mark_changed(exp: Any, variant: str, root: Path, records: Path, rows: list[list[str]], name: str) -> str:
    """Mark the rows of finished cells that today's config would not compute as they are; the note listing them.

    Cells are run folders here or run records; a marked row reads "(changed)" after the method; the note is ""
    when there are none.
    """
    every = experiments.cells(exp, variant)
    here = [c for c in every if is_done(c.folder(root))]
    changed: dict[Any, list[str]] = changed_runs(here, root, [f"paths.root={root}"])
    for cell in every:
        record = experiments.recorded(cell, root, records)
        found = record and record_changes(record, cell.stage, [*cell.overrides, f"paths.root={root}"])
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
            renamed = f" (options renamed since: {', '.join(record['migrated'])})" if record.get("migrated") else ""
            lines.append(f"- {cell.label}: finished {record['done'][:16]}, commit {commit}{renamed}")
    if not lines:
        return ""
    shown = records.relative_to(repo_root()) if records.is_relative_to(repo_root()) else records
    listing = "\n".join(lines)
    return f"\nCells read from run records ({shown}/; their run folders are not on this machine):\n{listing}\n"


def table(args: argparse.Namespace) -> None:
    """Record the finished cells, then write the table and the figure (and log them to W&B)."""
    exp = experiments.load(args.name)
    if not experiments.cells(exp, args.variant):
        raise SystemExit(f"{args.name} ({args.variant}) has steps only, no table: `run` makes its runs.")
    root, records = Path(args.root), Path(args.records)
    if args.record:  # the finished cells here, kept in the repository beside the table they make
        every = [c.folder(root) for c in experiments.cells(exp, args.variant)]
        written = [run_records.write(folder, records) for folder in every]
        dirty = [f for f, w in zip(every, written, strict=True) if w is None and is_done(f)]
        print(f"{sum(p is not None for p in written)} finished cells recorded under {records}")
        if dirty:
            print(f"{len(dirty)} finished cells not recorded: made from uncommitted changes (commit, then rerun "
                  f"them with --on-config-change redo): {'; '.join(f.name for f in dirty[:4])}")  # fmt: skip
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


def grid(exp: Any, variant: str) -> str:
    """A variant's grid in one line: steps, models x rows x points, cells."""
    spec = exp.variants[variant]
    found = experiments.cells(exp, variant)
    parts = [f"{len(experiments.steps(exp, variant))} steps"] if spec.get("steps") else []
    if found:
        rows = len(dict.fromkeys(c.row for c in found))
        models = len(dict.fromkeys(c.model for c in found))
        parts.append(f"{models} model(s) x {rows} rows = {len(found)} cells")
    return ", ".join(parts)


def measured(exp: Any, variant: str) -> str:
    """The summed run time of a variant's finished cells (run folders here, else run records), or ""."""
    root, records = outputs_root(), run_records.records_root()
    found = [experiments.read(c, root, "", (), records) for c in experiments.cells(exp, variant)]
    seconds = [float(r.metrics.get("wall_s") or 0.0) for r in found if r is not None]
    if not seconds:
        return ""
    total = sum(seconds) / 60
    spent = f"{total:.0f} min" if total < 90 else f"{total / 60:.1f} h"
    return f"; measured: {spent} over the {len(seconds)} finished cells of the {variant} variant"


def listing(name: str) -> str:
    """One experiment for ``list``: title, each variant's grid, the cost line, the table it writes."""
    exp = experiments.load(name)
    out = Path("docs/results/experiments") / f"{name}_twin.md"
    table_line = str(out) if experiments.cells(exp, "twin") else "none (steps only)"
    return (
        f"{name}: {exp.title}\n  twin: {grid(exp, 'twin')}\n  hub:  {grid(exp, 'hub')}\n"
        f"  cost: {exp.get('cost', 'see docs/results/sizing.md')}{measured(exp, 'twin')}\n  table: {table_line}"
    )


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("list", help="every experiment: its grid, its cost and its table")
    index_parser = sub.add_parser("index", help="docs/results/README.md: every committed table and how to rebuild it")
    index_parser.add_argument("--out", default="docs/results")
    renamer = sub.add_parser("migrate", help="rename run folders and run records made under renamed options")
    renamer.add_argument("--dry-run", action="store_true", help="list what would change, change nothing")
    for action in ("run", "table"):
        p = sub.add_parser(action)
        p.add_argument("name")
        p.add_argument("--variant", default="twin", choices=["twin", "hub"])
        p.add_argument("--wandb", action=argparse.BooleanOptionalAction, default=True,
                       help="log to W&B, grouped per experiment (offline unless WANDB_MODE=online)")  # fmt: skip
    runner, tables = sub.choices["run"], sub.choices["table"]
    runner.add_argument("--print", action="store_true", help="print the commands of the missing cells only")
    only = "only these rows, in this order (label or label@point, comma-separated; the full cache runs first)"
    runner.add_argument("--rows", default=None, help=f"{only}, e.g. kvzap_mlp@keep_ratio=0.5,kvzip_plus")
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
                print(listing(name))
        elif args.action == "migrate":
            for line in migrate.run(outputs_root(), run_records.records_root(), args.dry_run):
                print(line)
        elif args.action == "index":
            print(index.write(Path(args.out), outputs_root(), run_records.records_root()))
        else:
            (run if args.action == "run" else table)(args)
    except KVResearchError as error:
        raise SystemExit(str(error)) from error


if __name__ == "__main__":
    main()
