"""Run folders: names, ids, references between runs, atomic files, and the stage runner.

A stage is ``run(cfg, ctx) -> dict``. :func:`execute` runs it in ``cfg.out_dir``: it writes the config
and versions first, the metrics atomically and ``DONE`` last. A folder holding ``DONE`` is skipped,
unless it is damaged (unreadable metrics, or what the stage's ``verify`` finds): then the stage runs
again and resumes from what the run saved. ``force=true`` empties the folder and starts over.

Runs hand work to each other by reference (``conf/paths/``): a run folder, absolute or relative to the
outputs root, or a run id (8 hex digits, printed when a run finishes, derived from ``<stage>/<name>``),
which needs no quoting on a command line where folder names hold ``=`` and ``,``.

:func:`stage_main` is the Hydra shell. A :class:`KVResearchError` becomes one paragraph on stderr and
exit code 2; in a ``-m`` sweep a failed run is reported and the sweep goes on, and :class:`SweepReport`
lists the failures at the end (exit code 2).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from importlib import import_module, metadata
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from kvresearch.config_check import check_run, note_input, run_changes, take_inputs
from kvresearch.errors import KVResearchError
from kvresearch.tracking import Tracker, tracker

PACKAGE_DIR = Path(__file__).resolve().parent
CONF_DIR = PACKAGE_DIR.parent / "conf"
OUTPUTS_ENV = "KVRESEARCH_OUTPUTS"
TRACKED_PACKAGES = (
    "kvresearch",
    "torch",
    "transformers",
    "kvpress",
    "datasets",
    "hydra-core",
    "lightning",
    "wandb",
    "scikit-learn",
    "lm-eval",
    "triton",
    "numpy",
    "safetensors",
)
MAX_NAME = 200  # file systems refuse names over 255 bytes
RUN_ID = re.compile(r"[0-9a-f]{8}")
KEPT_ON_FORCE = (".hydra",)  # Hydra's own record of the job, written before the stage starts


def repo_root() -> Path:
    """The checkout that holds this package (editable install), else the working directory."""
    root = PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def outputs_root() -> Path:
    """Where runs live: ``$KVRESEARCH_OUTPUTS``, else ``outputs/`` in the checkout (the one place it is decided)."""
    return Path(os.environ.get(OUTPUTS_ENV) or repo_root() / "outputs").expanduser()


def run_name(override_dirname: str = "") -> str:
    """A run folder name from Hydra's override string: ``default`` when there are none.

    A name over ``MAX_NAME`` bytes keeps its start and ends in a hash of the whole string (the full
    overrides are in the run's config.yaml), so long sweeps still get one stable folder per run.
    """
    name = (override_dirname.strip() or "default").replace("/", "_").replace(os.sep, "_")
    if len(name.encode()) <= MAX_NAME:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:12]
    return name.encode()[: MAX_NAME - 13].decode(errors="ignore") + "-" + digest


def run_id(folder: Path) -> str:
    """A run's short id: 8 hex digits of the sha1 of ``<stage>/<name>``."""
    return hashlib.sha1(f"{Path(folder).parent.name}/{Path(folder).name}".encode()).hexdigest()[:8]


def is_done(out_dir: Path) -> bool:
    """Whether the run folder holds its ``DONE`` marker."""
    return (Path(out_dir) / "DONE").is_file()


def resolve_run(ref: str | Path, stage: str, root: str | Path | None = None) -> Path:
    """The finished run folder that ``ref`` names: a folder (absolute, under ``root`` or ``root/stage``) or a run id.

    Raises:
        KVResearchError: no such run, or the run is not finished; the message lists the finished runs.
    """
    if isinstance(ref, int | float):  # Hydra reads an unquoted id such as 12e45678 or 01234567 as a number
        raise KVResearchError(f"The run reference {ref!r} was read as a number: quote the run id (key='<id>').")
    root = Path(root) if root is not None else outputs_root()
    path = Path(text := str(ref).strip()).expanduser()
    candidates = [path] if path.is_absolute() else [root / text, root / stage / text, Path.cwd() / text]
    folder = next((c for c in candidates if c.is_dir()), None)
    if folder is None and RUN_ID.fullmatch(text):
        folder = next((p for p in sorted(root.glob(f"{stage}/*")) if p.is_dir() and run_id(p) == text), None)
    finished = sorted(p.parent for p in root.glob(f"{stage}/*/DONE"))
    listing = "; ".join(f"{stage}/{p.name} (id {run_id(p)})" for p in finished[:12]) or "none"
    if folder is None:
        raise KVResearchError(
            f"No {stage} run '{text}' under {root}: pass a run folder (absolute, relative to the outputs root, "
            f"or its name under {stage}/) or a run id. Finished {stage} runs there: {listing}."
        )
    if not is_done(folder):
        raise KVResearchError(
            f"The {stage} run {folder} is not finished (no DONE): run or resume it first (re-running its "
            f"command continues it), or point at a finished run. Finished {stage} runs: {listing}."
        )
    return note_input(folder, root)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically."""
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: Path, fix: str) -> Any:
    """Read a JSON file, or raise one paragraph naming it and saying what to do (``fix``)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise KVResearchError(f"{path} is missing. {fix}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise KVResearchError(f"{path} is not valid JSON (damaged or half-written: {error}). {fix}") from error


def versions() -> dict[str, Any]:
    """Package versions, Python, platform and the git commit (with a dirty flag) of the checkout."""
    packages: dict[str, str | None] = {}
    for name in TRACKED_PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    git: dict[str, Any] = {"commit": None, "dirty": None}
    try:
        root = str(repo_root())
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if commit.returncode == 0:
            status = subprocess.run(
                ["git", "-C", root, "status", "--porcelain"], capture_output=True, text=True, timeout=10
            )
            git = {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "packages": packages,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git": git,
        "checkout": str(repo_root()),  # absolute paths in config.yaml compare relative to it (config_check)
    }


# ----------------------------------------------------------------------------------------- Hydra context
def hydra_overrides() -> tuple[list[str], list[str]]:
    """The job's task overrides and the keys left out of run names; empty outside a Hydra job."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return [], []
    hydra_cfg = HydraConfig.get()
    return list(hydra_cfg.overrides.task), list(hydra_cfg.job.config.override_dirname.exclude_keys)


def sibling_runs(out_dir: Path, keep: tuple[str, ...], add: str, drop: tuple[str, ...] = ()) -> list[Path]:
    """Folders of the runs with only this job's overrides of the groups ``keep``, plus ``add`` or not.

    Override keys in ``drop`` are left out of both names.

    The first is named as Hydra names a run given ``add`` explicitly, the second as one that takes its
    default; e.g. the ``method=full`` runs beside ``method=kvzap_mlp,benchmark.lengths=[2048]`` are
    ``benchmark.lengths=[2048],method=full`` and ``benchmark.lengths=[2048]``.
    """
    overrides, excluded = hydra_overrides()
    kept = []
    for line in overrides:
        key = line.split("=", 1)[0].lstrip("+~")
        if key not in excluded and key not in drop and key.split(".")[0] in keep:
            kept.append(line)
    return [Path(out_dir).parent / run_name(",".join(sorted(lines))) for lines in ([*kept, add], kept)]


def run_with(out_dir: Path, add: str) -> Path:
    """The folder of the run named by all of this job's overrides plus ``add`` (a part of a sharded run)."""
    overrides, excluded = hydra_overrides()
    by_key = {line.split("=", 1)[0].lstrip("+~"): line for line in [*overrides, add]}  # the last wins, as in a sweep
    kept = [line for key, line in by_key.items() if key not in excluded]
    return Path(out_dir).parent / run_name(",".join(sorted(kept)))


def _unless_set(value: Any, default: Any) -> Any:
    """``default`` when ``value`` is null, else null: one knob's default that gives way to another."""
    return default if value is None else None


def _register_resolvers() -> None:
    resolvers: dict[str, Callable[..., Any]] = {
        "kvr.repo_root": lambda: str(repo_root()),
        "kvr.outputs_root": lambda: str(outputs_root()),
        "kvr.data": lambda name: str(PACKAGE_DIR / "benchmarks" / "data" / name),  # vendored benchmark data
        "kvr.run_name": run_name,
        "kvr.unless_set": _unless_set,
        "kvr.model_name": lambda *a: import_module("kvresearch.models.architecture").model_name(*a),  # lazily
    }
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


_register_resolvers()


# ----------------------------------------------------------------------------------------- the runner
@dataclass
class RunContext:
    """What a stage gets besides its config: its folder and the tracker."""

    out_dir: Path
    tracker: Tracker


StageFn = Callable[[DictConfig, RunContext], Mapping[str, Any]]
VerifyFn = Callable[[Path], None]  # raises KVResearchError naming what is damaged


def _damage(out_dir: Path, verify: VerifyFn | None) -> str | None:
    """Why a DONE run cannot be trusted, or None."""
    try:
        read_json(out_dir / "metrics.json", "")
        if verify is not None:
            verify(out_dir)
    except KVResearchError as error:
        return str(error).strip()
    return None


def clear_run(out_dir: Path) -> None:
    """Empty a run folder for ``force=true`` (Hydra's own ``.hydra`` record of the job stays)."""
    if not out_dir.is_dir():
        return
    for entry in out_dir.iterdir():
        if entry.name in KEPT_ON_FORCE or entry.suffix == ".log":
            continue
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def folder_changes(folder: Path, stage: str, overrides: list[str]) -> list[str]:
    """What differs between a run folder's stored config and the one ``overrides`` compose today ([] if none).

    For runners that skip finished runs without starting their stage (scripts/experiment.py).
    """
    if not (Path(folder) / "config.yaml").is_file():
        return []
    return run_changes(folder, today(stage, overrides), repo_root()) or []


def today(stage: str, overrides: list[str]) -> DictConfig:
    """The config a run of ``stage`` with these command-line ``overrides`` gets today (Hydra's own left out)."""
    return compose_config(stage, [o for o in overrides if not o.startswith(("hydra.", "hydra/"))])


def execute(cfg: DictConfig, fn: StageFn, verify: VerifyFn | None = None) -> dict[str, Any]:
    """Run a stage in ``cfg.out_dir`` unless it is already DONE and intact; return its metrics.

    A folder made with other settings (:func:`kvresearch.config_check.check_run`) is refused before anything
    is read or written.
    """
    out_dir = Path(cfg.out_dir)
    if cfg.get("force", False):
        clear_run(out_dir)
    else:
        check_run(out_dir, cfg, repo_root())
    if is_done(out_dir):
        problem = _damage(out_dir, verify)
        if problem is None:
            print(f"[kvresearch] {out_dir} is DONE; skipping (force=true redoes it)", flush=True)
            return dict(read_json(out_dir / "metrics.json", ""))
        print(
            f"[kvresearch] {out_dir} holds DONE but cannot be trusted: {problem} Running the stage again: it "
            "keeps what is intact and redoes the rest.",
            flush=True,
        )
        (out_dir / "DONE").unlink()
    out_dir.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    write_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    write_json(out_dir / "versions.json", versions())
    start = time.perf_counter()
    stage = str(cfg.get("stage", "stage"))
    overrides, _ = hydra_overrides()
    run = {"stage": stage, "name": out_dir.name, "id": run_id(out_dir), "overrides": overrides}
    take_inputs()  # what earlier work in this process read is not this run's
    with tracker(
        cfg.get("logger"), {str(k): v for k, v in resolved.items()}, out_dir, f"{stage}/{out_dir.name}", stage
    ) as active:
        metrics = {**dict(fn(cfg, RunContext(out_dir, active))), "run": run, "inputs": take_inputs()}
        metrics.setdefault("wall_s", round(time.perf_counter() - start, 3))
        active.summary(metrics)
    write_json(out_dir / "metrics.json", metrics)
    write_atomic(out_dir / "DONE", datetime.now().astimezone().isoformat(timespec="microseconds") + "\n")
    print(f"[kvresearch] finished {stage}/{out_dir.name} (run id {run['id']}): {out_dir}", flush=True)
    return metrics


_FAILED: list[tuple[str, str]] = []  # (run folder, message) of the jobs of this process that failed


class SweepReport(Callback):
    """Hydra callback: after a ``-m`` sweep, list the runs that failed and exit with code 2."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Print the failures of the sweep, if any, and exit non-zero."""
        if not _FAILED:
            return
        lines = "\n".join(f"  {folder}\n    {message.splitlines()[0]}" for folder, message in _FAILED)
        print(f"\n[kvresearch] {len(_FAILED)} run(s) of this sweep failed:\n{lines}", file=sys.stderr, flush=True)
        sys.exit(2)


def stage_main(config_name: str, fn: StageFn, verify: VerifyFn | None = None) -> Callable[[], None]:
    """The Hydra entry point of a stage: ``python -m kvresearch.stages.<name> key=value ...``."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)
    def main(cfg: DictConfig) -> None:
        sweep = HydraConfig.get().mode == RunMode.MULTIRUN
        try:
            execute(cfg, fn, verify)
        except KVResearchError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            if not sweep:
                sys.exit(2)
            _FAILED.append((str(cfg.out_dir), str(error)))
        except Exception as error:
            if not sweep:
                raise
            traceback.print_exc()
            _FAILED.append((str(cfg.out_dir), f"{type(error).__name__}: {error}"))

    return main


def build(node: Any) -> Any:
    """``hydra.utils.instantiate``, with a :class:`KVResearchError` raised while building passed on as it is."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node)
    except InstantiationException as error:
        cause: BaseException | None = error
        while cause is not None and not isinstance(cause, KVResearchError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None


def compose_config(name: str, overrides: list[str] | None = None) -> DictConfig:
    """``conf/<name>.yaml`` composed with ``overrides``, for code that needs a config outside a stage.

    Works inside a running Hydra job too (its search path is this same ``conf/``): lm-eval's model and tasks.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(name, overrides=overrides or [])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=overrides or [])
