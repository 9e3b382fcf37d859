"""Hand-offs: the one function that turns a reference to a finished run into its folder.

A reference is a run folder (absolute, relative to the outputs root, or its name under ``<stage>/``), a
run id (8 hex digits, printed when a run finishes) for the command line, or an experiment's named step
``<experiment>:<step>`` (``conf/experiment/<experiment>.yaml``, ``steps:``), which names a run by its stage
and overrides and needs no quoting. Configs in the repository use folders and named steps, never ids.
"""

from __future__ import annotations

from pathlib import Path

from kvresearch.errors import KVResearchError
from kvresearch.runs.compose import sibling_runs
from kvresearch.runs.naming import RUN_ID, is_done, outputs_root, run_id
from kvresearch.runs.provenance import Inputs
from kvresearch.runs.records import path_of, read, records_root
from kvresearch.runs.steps import step_run

STEP_SEPARATOR = ":"


def step_folder(ref: str, root: Path) -> tuple[str, Path] | None:
    """The (stage, folder) of an experiment's named step ``<experiment>:<step>``; None for other references."""
    name, sep, step = ref.partition(STEP_SEPARATOR)
    if not sep or "/" in name or not name or not step:
        return None
    return step_run(name, step, root)


def resolve_run(ref: str | Path, stage: str, root: str | Path | None = None, recorded_ok: bool = False) -> Path:
    """The finished run folder that ``ref`` names (see the module's docstring).

    Args:
        ref: the reference.
        stage: the stage whose run it must be.
        root: the outputs root (default: ``$KVRESEARCH_OUTPUTS`` or outputs/).
        recorded_ok: a folder that is not here but has a run record counts as finished.

    Raises:
        KVResearchError: no such run, or the run is not finished; the message lists the finished runs.
    """
    if isinstance(ref, int | float):  # Hydra reads an unquoted id such as 12e45678 or 01234567 as a number
        raise KVResearchError(f"The run reference {ref!r} was read as a number: quote the run id (key='<id>').")
    root = Path(root) if root is not None else outputs_root()
    text = str(ref).strip()
    path = Path(text).expanduser()
    step = step_folder(text, root)
    if step is not None:
        if step[0] != stage:
            raise KVResearchError(f"The step '{text}' is a {step[0]} run, not a {stage} run: name a {stage} step.")
        candidates = [step[1]]
    else:
        candidates = [path] if path.is_absolute() else [root / text, root / stage / text, Path.cwd() / text]
    folder = next((c for c in candidates if c.is_dir() or (recorded_ok and read(path_of(records_root(), c)))), None)
    if folder is None and RUN_ID.fullmatch(text):
        folder = next((p for p in sorted(root.glob(f"{stage}/*")) if p.is_dir() and run_id(p) == text), None)
    finished = sorted(p.parent for p in root.glob(f"{stage}/*/DONE"))
    listing = "; ".join(f"{stage}/{p.name} (id {run_id(p)})" for p in finished[:12]) or "none"
    if folder is None:
        how = f"run that step first (make experiment-{text.partition(':')[0]})" if step else (
            f"pass a run folder (absolute, relative to the outputs root, or its name under {stage}/), a run id, "
            "or an experiment's step (<experiment>:<step>)"
        )  # fmt: skip
        raise KVResearchError(f"No {stage} run '{text}' under {root}: {how}. Finished {stage} runs there: {listing}.")
    if not is_done(folder) and not (recorded_ok and read(path_of(records_root(), folder))):
        raise KVResearchError(
            f"The {stage} run {folder} is not finished (no DONE): run or resume it first (re-running its "
            f"command continues it), or point at a finished run. Finished {stage} runs: {listing}."
        )
    return folder.resolve() if folder.is_dir() else folder


def full_cache_run(
    stage: str,
    explicit: str | None,
    out_dir: Path,
    groups: tuple[str, ...],
    inputs: Inputs,
    drops: tuple[tuple[str, ...], ...] = ((),),
    recorded_ok: bool = False,
) -> Path | None:
    """The finished ``method=full`` run whose outputs a run compares against; None when there is none.

    Evaluate and fidelity both find their reference here.

    Args:
        stage: the stage of both runs.
        explicit: a reference (:func:`resolve_run`) given by the user; it wins.
        out_dir: this run's folder; the reference is the run named by this job's overrides of the config
            groups ``groups`` plus ``method=full`` (or the default method), ``drops`` tried in turn as the
            override keys to leave out of the name (e.g. a shard's index, then every shard key).
        groups: the config groups a full-cache output depends on (their overrides name the reference).
        inputs: where the reference is noted.
        drops: override keys to leave out of the name, tried in turn.
        recorded_ok: a run record counts when no run folder is finished (it finished on another machine).
    """
    if explicit:
        return inputs.add(resolve_run(explicit, stage, inputs.root, recorded_ok))
    candidates = [p for drop in drops for p in sibling_runs(out_dir, groups, "method=full", drop) if p != out_dir]
    found = next((p for p in candidates if is_done(p)), None)
    if found is None and recorded_ok:
        found = next((p for p in candidates if read(path_of(records_root(), p))), None)
        if found is not None:
            print(f"[kvresearch] full-cache answers from the run record of {found.name}", flush=True)
    return inputs.add(found) if found is not None else None
