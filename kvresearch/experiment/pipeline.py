"""Submit the whole pipeline of ``make reproduce`` as cluster jobs with dependencies: one command.

    python -m kvresearch.experiment.pipeline [--cluster slurm|local] [--shards 8] [--partition gpu]
        [--extract-args "..."] [--train-surrogate-args "..."] [--evaluate-args "..."]
        [--dry-run] [-- model=... overrides for extract and evaluate, the stages that load the model]

Jobs, each a stage run with its own run folder (``outputs/<stage>/<overrides>``, skipped when finished):

1. ``extract`` parts: ``extract.num_shards=N extract.shard_index=k``, one job each (an array);
2. the merge: ``extract.num_shards=N`` (after every part);
3. ``train_surrogate`` linear and MLP on the merged run (after the merge);
4. ``evaluate``: the cells of ``--experiment`` (default ``kvzap_ruler``, its ``--variant``, the first model's
   cells: the surrogates are trained for one model) as ``make reproduce`` runs them: the full cache first,
   then one job per method and budget (they reuse its answers); overrides given after ``--`` replace the
   cells' own (``model=...``), ``--evaluate-args`` are added to every cell;
5. the tables of every evaluate run (``python -m kvresearch.reports.tables``, after every evaluation; the KVzap
   runs' names hold the surrogates' run ids, so they are not the experiment's cells that ``make table-<name>`` reads).

Hand-offs are run ids computed before submission (``kvresearch.runs.run_id`` of the folder each stage
will write), so no job looks for another's output by any other route. On SLURM every job is submitted
at once with ``--dependency=afterok:<ids>`` and the script exits; with ``--cluster local`` (submitit's
local executor) each step waits for the one before. ``--dry-run`` prints the jobs and submits nothing.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvresearch import experiment as experiments
from kvresearch.runs import outputs_root, repo_root, run_id, run_name

STAGES = ("extract", "train_surrogate", "evaluate")


@dataclass
class Job:
    """One job: a name, the command it runs, the names of the jobs it waits for."""

    name: str
    command: list[str]
    after: list[str] = field(default_factory=list)


def folder_id(stage: str, overrides: list[str]) -> str:
    """The run id of the folder a stage run with ``overrides`` writes (as Hydra names it)."""
    return run_id(Path(stage) / run_name(",".join(sorted(overrides))))


def merged(*groups: list[str]) -> list[str]:
    """Overrides with one value per key: a later group's wins (``model=`` given on the command line)."""
    return list({line.split("=", 1)[0].lstrip("+~"): line for group in groups for line in group}.values())


def plan(
    shards: int,
    extra: list[str],
    per_stage: dict[str, list[str]] | None = None,
    tables: str = "docs/results",
    python: str = sys.executable,
    experiment: str = "kvzap_ruler",
    variant: str = "twin",
) -> list[Job]:
    """The jobs in submission order; ``extra`` goes to the stages that load the model, ``per_stage`` to one."""
    own = per_stage or {}
    stage = lambda name, *args: [python, "-m", f"kvresearch.stages.{name}", *args]
    parts = [*extra, *own.get("extract", []), f"extract.num_shards={shards}"]
    jobs = [Job(f"extract-{k}", stage("extract", *parts, f"extract.shard_index={k}")) for k in range(shards)]
    jobs.append(Job("merge", stage("extract", *parts), [j.name for j in jobs]))
    extract = f"paths.extract={folder_id('extract', parts)}"
    surrogates = {}
    for kind in ("linear", "mlp"):
        train = [*own.get("train_surrogate", []), extract, f"surrogate={kind}"]  # no model: it reads the extract
        jobs.append(Job(f"train-{kind}", stage("train_surrogate", *train), ["merge"]))
        surrogates[kind] = f"paths.surrogate_{kind}={folder_id('train_surrogate', train)}"
    cells = experiments.cells(experiments.load(experiment), variant)
    cells = [c for c in cells if c.model == cells[0].model and c.stage == "evaluate"]
    others = iter(range(len(cells)))
    for cell in cells:
        kvzap = any(o.startswith("method=kvzap") for o in cell.overrides)
        handoff = list(surrogates.values()) if kvzap else []  # only KVzap reads the surrogates
        args = merged(list(cell.overrides), extra, own.get("evaluate", []))
        if cell.reference:
            jobs.append(Job("evaluate-full", stage("evaluate", *args), ["train-linear", "train-mlp"]))
        else:
            jobs.append(Job(f"evaluate-{next(others)}", stage("evaluate", *args, *handoff), ["evaluate-full"]))
    last = [j.name for j in jobs if j.name.startswith("evaluate")]
    # The KVzap runs' names hold the surrogates' run ids, so the per-benchmark tables (every evaluate run) are built.
    jobs.append(Job("tables", [python, str(repo_root() / "scripts" / "make_tables.py"), "--out", tables], last))
    return jobs


def submit(jobs: list[Job], args: argparse.Namespace) -> None:
    """Submit ``jobs`` with submitit: SLURM dependencies, or one step after another with the local executor."""
    import submitit

    folder = Path(args.root) / ".submitit" / "pipeline" / "%j"
    executor = submitit.AutoExecutor(folder=folder, cluster=args.cluster)
    slurm = {"slurm_partition": args.partition} if args.partition else {}
    executor.update_parameters(timeout_min=args.timeout_min, gpus_per_node=args.gpus, cpus_per_task=args.cpus, **slurm)
    submitted: dict[str, submitit.Job] = {}
    for job in jobs:
        waits = [submitted[name] for name in job.after]
        if args.cluster == "local":
            for waited in waits:
                waited.result()  # raises if that step failed: nothing after it runs
        elif waits:
            dependency = "afterok:" + ":".join(str(w.job_id) for w in waits)
            executor.update_parameters(slurm_additional_parameters={"dependency": dependency})
        executor.update_parameters(name=f"kvr-{job.name}")
        submitted[job.name] = executor.submit(submitit.helpers.CommandFunction(job.command, cwd=str(repo_root())))
        print(f"{job.name}: job {submitted[job.name].job_id}", flush=True)
    if args.cluster == "local":
        submitted[jobs[-1].name].result()


def main() -> None:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", choices=["slurm", "local"], default="slurm")
    parser.add_argument("--shards", type=int, default=8, help="extract parts (jobs)")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per job")
    parser.add_argument("--cpus", type=int, default=8, help="CPUs per job")
    parser.add_argument("--timeout-min", type=int, default=240)
    parser.add_argument("--root", default=str(outputs_root()), help="where submitit keeps job scripts and logs")
    parser.add_argument("--experiment", default="kvzap_ruler", help="the evaluate cells: conf/experiment/<name>.yaml")
    parser.add_argument("--variant", default="twin", choices=["twin", "hub"])
    parser.add_argument("--tables-out", default="docs/results", help="where the tables job writes")
    parser.add_argument("--dry-run", action="store_true", help="print the jobs, submit nothing")
    for name in STAGES:
        parser.add_argument(f"--{name.replace('_', '-')}-args", default="", help=f"overrides for {name} only")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for extract and evaluate (after --)")
    args = parser.parse_args()
    per_stage = {name: shlex.split(getattr(args, f"{name}_args")) for name in STAGES}
    jobs = plan(
        args.shards, args.overrides, per_stage, args.tables_out, experiment=args.experiment, variant=args.variant
    )
    if args.dry_run:
        for job in jobs:
            print(f"{job.name} (after {', '.join(job.after) or 'nothing'}): {' '.join(job.command)}")
        return
    submit(jobs, args)


if __name__ == "__main__":
    main()
