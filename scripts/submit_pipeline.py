"""Submit the whole pipeline of ``make reproduce`` as cluster jobs with dependencies: one command.

    .venv/bin/python scripts/submit_pipeline.py [--cluster slurm|local] [--shards 8] [--partition gpu]
        [--extract-args "..."] [--train-surrogate-args "..."] [--evaluate-args "..."]
        [--dry-run] [-- model=... overrides for extract and evaluate, the stages that load the model]

Jobs, each a stage run with its own run folder (``outputs/<stage>/<overrides>``, skipped when finished):

1. ``extract`` parts: ``extract.num_shards=N extract.shard_index=k``, one job each (an array);
2. the merge: ``extract.num_shards=N`` (after every part);
3. ``train_surrogate`` linear and MLP on the merged run (after the merge);
4. ``evaluate``: the full cache, then the methods of ``make sweep-ruler`` (after training; the methods after
   the full cache, whose answers they reuse); ``--evaluate-args`` replaces the RULER subset;
5. the tables (``scripts/make_tables.py``, after every evaluation).

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

from kvresearch.runs import outputs_root, repo_root, run_id, run_name

STAGES = ("extract", "train_surrogate", "evaluate")
KVZAP_THRESHOLDS = "-4.5,-3.5,-2.5"  # the Makefile's
RULER = [
    "benchmark.lengths=[2048]",
    "benchmark.samples_per_task=4",
    "evaluate.max_new_tokens=48",
    "benchmark.tasks=[niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue]",
]
SWEEP = [  # make sweep-ruler, after method=full
    ["method=kvzap_mlp,kvzap_linear", f"method.threshold={KVZAP_THRESHOLDS}"],
    ["method=kvzip_plus", "method.keep_ratio=0.33"],
    ["method=snapkv,streaming_llm", "method.keep_ratio=0.5,0.33"],
]


@dataclass
class Job:
    """One job: a name, the command it runs, the names of the jobs it waits for."""

    name: str
    command: list[str]
    after: list[str] = field(default_factory=list)


def folder_id(stage: str, overrides: list[str]) -> str:
    """The run id of the folder a stage run with ``overrides`` writes (as Hydra names it)."""
    return run_id(Path(stage) / run_name(",".join(sorted(overrides))))


def plan(
    shards: int,
    extra: list[str],
    per_stage: dict[str, list[str]] | None = None,
    tables: str = "docs/results",
    python: str = sys.executable,
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
    evaluate = [*extra, *(own.get("evaluate") or RULER)]
    jobs.append(Job("evaluate-full", stage("evaluate", *evaluate, "method=full"), ["train-linear", "train-mlp"]))
    for i, sweep in enumerate(SWEEP):
        handoff = list(surrogates.values()) if "kvzap" in sweep[0] else []  # only KVzap reads the surrogates
        jobs.append(Job(f"evaluate-{i}", stage("evaluate", "-m", *evaluate, *handoff, *sweep), ["evaluate-full"]))
    last = [j.name for j in jobs if j.name.startswith("evaluate")]
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", choices=["slurm", "local"], default="slurm")
    parser.add_argument("--shards", type=int, default=8, help="extract parts (jobs)")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--gpus", type=int, default=1, help="GPUs per job")
    parser.add_argument("--cpus", type=int, default=8, help="CPUs per job")
    parser.add_argument("--timeout-min", type=int, default=240)
    parser.add_argument("--root", default=str(outputs_root()), help="where submitit keeps job scripts and logs")
    parser.add_argument("--tables-out", default="docs/results", help="where the tables job writes")
    parser.add_argument("--dry-run", action="store_true", help="print the jobs, submit nothing")
    for name in STAGES:
        parser.add_argument(f"--{name.replace('_', '-')}-args", default="", help=f"overrides for {name} only")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for extract and evaluate (after --)")
    args = parser.parse_args()
    per_stage = {name: shlex.split(getattr(args, f"{name}_args")) for name in STAGES}
    jobs = plan(args.shards, args.overrides, per_stage, args.tables_out)
    if args.dry_run:
        for job in jobs:
            print(f"{job.name} (after {', '.join(job.after) or 'nothing'}): {' '.join(job.command)}")
        return
    submit(jobs, args)


if __name__ == "__main__":
    main()
