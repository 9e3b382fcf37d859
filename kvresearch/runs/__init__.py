"""Run bookkeeping, one module per job, the arrows running one way.

- :mod:`~kvresearch.runs.naming`: the outputs root, run names and ids, ``DONE``, a stage's folder from overrides;
- :mod:`~kvresearch.runs.files`: atomic writes, JSON reads with errors that say what to do;
- :mod:`~kvresearch.runs.records`: run records (a finished run as one committed JSON file);
- :mod:`~kvresearch.runs.provenance`: versions, commit and diff, the runs a run read (``Inputs``);
- :mod:`~kvresearch.runs.compose`: Hydra glue (overrides, sibling runs, resolvers, composing, building);
- :mod:`~kvresearch.runs.changes`: is a run folder or record still what today's config computes;
- :mod:`~kvresearch.runs.resolve`: hand-offs (a folder, a run id, or an experiment's named step);
- :mod:`~kvresearch.runs.runner`: the stage runner and its Hydra entry point.

The names below are the ones stages and tools use.
"""

from kvresearch.runs.compose import build, compose_config, run_with, sibling_runs, today
from kvresearch.runs.files import read_json, write_atomic, write_json
from kvresearch.runs.naming import CONF_DIR, PACKAGE_DIR, is_done, outputs_root, repo_root, run_folder, run_id, run_name
from kvresearch.runs.resolve import resolve_run
from kvresearch.runs.runner import RunContext, SweepReport, execute, stage_main

__all__ = [
    "CONF_DIR",
    "PACKAGE_DIR",
    "RunContext",
    "SweepReport",
    "build",
    "compose_config",
    "execute",
    "is_done",
    "outputs_root",
    "read_json",
    "repo_root",
    "resolve_run",
    "run_folder",
    "run_id",
    "run_name",
    "run_with",
    "sibling_runs",
    "stage_main",
    "today",
    "write_atomic",
    "write_json",
]
