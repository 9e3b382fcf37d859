"""Hydra glue.

This job's overrides, the runs named beside it, config resolvers, composing a stage's config outside a
job, and building objects from config nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvresearch.errors import KVResearchError
from kvresearch.runs.naming import CONF_DIR, PACKAGE_DIR, outputs_root, repo_root, run_name


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


def today(stage: str, overrides: list[str]) -> DictConfig:
    """The config a run of ``stage`` with these command-line ``overrides`` gets today (Hydra's own left out)."""
    return compose_config(stage, [o for o in overrides if not o.startswith(("hydra.", "hydra/"))])


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
