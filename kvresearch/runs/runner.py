"""The stage runner: a stage is ``run(cfg, ctx) -> dict``, run once per run folder.

:func:`execute` runs it in ``cfg.out_dir``: it writes the config and versions first, the metrics atomically
and ``DONE`` last. A folder holding ``DONE`` is skipped, unless it is damaged (unreadable metrics, or what
the stage's ``verify`` finds): then the stage runs again and resumes from what the run saved.
``force=true`` empties the folder and starts over. The runs a stage reads are noted in ``ctx.inputs``
(:class:`~kvresearch.runs.provenance.Inputs`) and kept in its metrics.

:func:`stage_main` is the Hydra shell. A :class:`KVResearchError` becomes one paragraph on stderr and
exit code 2; in a ``-m`` sweep a failed run is reported and the sweep goes on, and :class:`SweepReport`
lists the failures at the end (exit code 2).
"""

from __future__ import annotations

import shutil
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from kvresearch.errors import KVResearchError
from kvresearch.runs.changes import check_run
from kvresearch.runs.compose import hydra_overrides
from kvresearch.runs.files import read_json, write_atomic, write_json
from kvresearch.runs.naming import CONF_DIR, is_done, repo_root, run_id
from kvresearch.runs.provenance import Inputs, versions
from kvresearch.tracking import Tracker, tracker

KEPT_ON_FORCE = (".hydra",)  # Hydra's own record of the job, written before the stage starts


@dataclass
class RunContext:
    """What a stage gets besides its config: its folder and the tracker."""

    out_dir: Path
    tracker: Tracker
    inputs: Inputs  # the finished runs this run reads: add each one (kept in its metrics)


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


def execute(cfg: DictConfig, fn: StageFn, verify: VerifyFn | None = None) -> dict[str, Any]:
    """Run a stage in ``cfg.out_dir`` unless it is already DONE and intact; return its metrics.

    A folder made with other settings (:func:`kvresearch.runs.changes.check_run`) is refused before anything
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
    inputs = Inputs(cfg.paths.root)
    with tracker(
        cfg.get("logger"), {str(k): v for k, v in resolved.items()}, out_dir, f"{stage}/{out_dir.name}", stage
    ) as active:
        metrics = {**dict(fn(cfg, RunContext(out_dir, active, inputs))), "run": run, "inputs": inputs.as_dict()}
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
    def hydra_main(cfg: DictConfig) -> None:
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

    def main() -> None:
        problem = unparsable_override(sys.argv[1:])
        if problem:
            print(f"error: {problem}", file=sys.stderr, flush=True)
            sys.exit(2)
        hydra_main()

    return main


def unparsable_override(args: list[str]) -> str | None:
    """Why Hydra's command-line grammar refuses one of ``args``, in words that name the fix; None when it takes all.

    The usual cause is a run folder handed on unquoted (``paths.extract=extract/corpus.n_train_per_source=75``):
    a value holding ``=`` or ``,`` must be quoted, or the run named by its id or an experiment step.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            parser.parse_overrides([arg])
        except OverrideParseException as error:
            key, _, value = arg.partition("=")
            hint = (
                f"a value holding '=' or ',' must be quoted: '{key}=\"{value}\"' (quotes included, inside shell "
                "quotes), or name the run by its id or an experiment step (<experiment>:<step>)"
                if "=" in value or "," in value
                else "check its brackets and quotes"
            )
            detail = str(error).splitlines()[0]
            return f"The override {arg!r} cannot be parsed ({detail}): {hint}."
    return None
