"""Run folders: config.yaml, versions.json, metrics.json, then DONE; Hydra entry points.

A stage is ``run(cfg, ctx) -> dict``. :func:`execute` wraps it: it skips a run folder that already
holds ``DONE`` (unless ``force=true``), writes the config and versions first, the metrics atomically,
and ``DONE`` last, so an interrupted sweep is simply re-run. :func:`stage_main` is the Hydra shell,
which turns a :class:`KVResearchError` into one line on stderr and exit code 2.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvresearch.errors import KVResearchError
from kvresearch.tracking import Tracker, tracker

PACKAGE_DIR = Path(__file__).resolve().parent
CONF_DIR = PACKAGE_DIR.parent / "conf"
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


def repo_root() -> Path:
    """The checkout that holds this package (editable install), else the working directory."""
    root = PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


MAX_NAME = 200  # file systems refuse names over 255 bytes


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


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("kvr.repo_root"):
        OmegaConf.register_new_resolver("kvr.repo_root", lambda: str(repo_root()))
    if not OmegaConf.has_resolver("kvr.run_name"):
        OmegaConf.register_new_resolver("kvr.run_name", run_name)


_register_resolvers()


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


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
    return {"packages": packages, "python": sys.version.split()[0], "platform": platform.platform(), "git": git}


@dataclass
class RunContext:
    """What a stage gets besides its config: its folder and the tracker."""

    out_dir: Path
    tracker: Tracker


StageFn = Callable[[DictConfig, RunContext], Mapping[str, Any]]


def is_done(out_dir: Path) -> bool:
    return (out_dir / "DONE").is_file()


def execute(cfg: DictConfig, fn: StageFn) -> dict[str, Any]:
    """Run a stage in ``cfg.out_dir`` unless it is already DONE; return its metrics."""
    out_dir = Path(cfg.out_dir)
    if is_done(out_dir) and not cfg.get("force", False):
        print(f"[kvresearch] {out_dir} is DONE; skipping (force=true redoes it)", flush=True)
        return json.loads((out_dir / "metrics.json").read_text())
    (out_dir / "DONE").unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(resolved, dict)
    run_config = {str(k): v for k, v in resolved.items()}
    write_atomic(out_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    write_json(out_dir / "versions.json", versions())
    start = time.perf_counter()
    stage = str(cfg.get("stage", "stage"))
    with tracker(cfg.get("logger"), run_config, out_dir, f"{stage}/{out_dir.name}", stage) as active:
        metrics = dict(fn(cfg, RunContext(out_dir, active)))
        metrics.setdefault("wall_s", round(time.perf_counter() - start, 3))
        active.summary(metrics)
    write_json(out_dir / "metrics.json", metrics)
    write_atomic(out_dir / "DONE", time.strftime("%Y-%m-%dT%H:%M:%S%z") + "\n")
    return metrics


def stage_main(config_name: str, fn: StageFn) -> Callable[[], None]:
    """The Hydra entry point of a stage: ``python -m kvresearch.stages.<name> key=value ...``."""
    import hydra

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)
    def main(cfg: DictConfig) -> None:
        try:
            execute(cfg, fn)
        except KVResearchError as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)

    return main
