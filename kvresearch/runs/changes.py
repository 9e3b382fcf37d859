"""Is a run folder still what today's command would compute? Its settings and its inputs against today's.

A run folder is named by its command-line overrides only, so a change of a default in ``conf/`` (or of a
knob added since) gives the same folder to a different computation, and so does a run it read (a surrogate,
a full-cache run) redone since under the same name. :func:`changes` lists every setting whose stored value
differs from the current one; :func:`inputs_changed` every run read (``provenance.Inputs``) whose ``DONE`` stamp
changed; :func:`run_changes` reads a run folder for both, and :func:`check_run` refuses on any. Settings that
do not change what a run computes (:data:`BLIND`: where it lives, how it logs, whether it is forced) are
left out, and absolute paths under the outputs root or the checkout compare relative to them, so a moved
checkout or outputs folder is not a change; nor is a hand-off (``paths.*``) added since the run was made, nor
a surrogate hand-off (``paths.surrogate_*``): a method reads it through ``method.surrogate.run``, which is
compared, so a run that never loaded a surrogate is not changed by renaming one.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from kvresearch.errors import KVResearchError
from kvresearch.runs import migrate
from kvresearch.runs.compose import today
from kvresearch.runs.naming import repo_root
from kvresearch.runs.records import done_stamp

BLIND = ("force", "on_config_change", "logger", "paths.root", "out_dir", "run_name")
ON_CHANGE = ("refuse", "keep")  # a changed config stops the run, or the run is kept / resumed as it is
ABSENT = "<absent>"


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values (a list is one leaf): ``{"a": {"b": 1}}`` gives ``{"a.b": 1}``."""
    if not isinstance(node, Mapping):
        return {prefix: node}
    if not node and prefix:
        return {prefix: {}}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


READ_ELSEWHERE = "paths.surrogate_"  # hand-offs a run reads only through a key that is compared (method.surrogate)


def _blind(key: str) -> bool:
    return key.startswith(READ_ELSEWHERE) or any(key == b or key.startswith(b + ".") for b in BLIND)


def _relative(value: Any, roots: Mapping[str, str]) -> Any:
    """An absolute path under one of ``roots`` (label -> folder) as ``<label>/rest``; anything else as it is."""
    if not isinstance(value, str) or not value.startswith("/"):
        return value
    for label, root in roots.items():
        root = root.rstrip("/")
        if root and (value == root or value.startswith(root + "/")):
            return f"<{label}>{value[len(root) :]}"
    return value


def changes(
    stored: Mapping[str, Any],
    current: Mapping[str, Any],
    stored_roots: Mapping[str, str],
    current_roots: Mapping[str, str],
) -> list[str]:
    """``key: stored -> current`` for each setting that differs (``<absent>`` on the side that lacks it).

    Args:
        stored: the resolved config (nested mappings) as the run saved it.
        current: the resolved config as it is now.
        stored_roots: label -> folder (``outputs``, ``checkout``) the stored paths live under.
        current_roots: the same for the current paths.
    """
    old = {k: _relative(v, stored_roots) for k, v in flatten(stored).items() if not _blind(k)}
    new = {k: _relative(v, current_roots) for k, v in flatten(current).items() if not _blind(k)}
    found = []
    for key in sorted(old.keys() | new.keys()):
        before, now = old.get(key, ABSENT), new.get(key, ABSENT)
        if before == ABSENT and key.startswith("paths."):
            continue  # a hand-off added since: a run made before it existed cannot have read it
        if before != now:
            found.append(f"{key}: {before} -> {now}")
    return found


def resolved(cfg: DictConfig) -> dict[str, Any]:
    """``cfg`` resolved, without the blind top-level keys (``out_dir`` and ``run_name`` need Hydra to resolve)."""
    cfg = cfg.copy()
    with open_dict(cfg):
        for key in BLIND:
            if "." not in key and key in cfg:
                del cfg[key]
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


def run_changes(out_dir: Path, cfg: DictConfig, checkout: Path) -> list[str] | None:
    """What differs between the config stored in ``out_dir`` and ``cfg``; None when the folder holds none.

    ``checkout`` is the current checkout; the stored one is read from the run's ``versions.json``
    (``checkout``), or taken to be the current one for runs that predate that field.
    """
    path = Path(out_dir) / "config.yaml"
    if not path.is_file():
        return None
    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert isinstance(loaded, dict)
    stored = {str(k): v for k, v in loaded.items()}
    versions = Path(out_dir) / "versions.json"
    stored_checkout = str(checkout)
    with contextlib.suppress(OSError, ValueError, AttributeError):  # missing or damaged: paths compare as they are
        stored_checkout = str(json.loads(versions.read_text(encoding="utf-8")).get("checkout") or checkout)
    return stored_changes(stored, stored_checkout, stored_inputs(out_dir), cfg, checkout)


def stored_changes(
    stored: Mapping[str, Any],
    stored_checkout: str,
    inputs: Mapping[str, str],
    cfg: DictConfig,
    checkout: Path,
    unknown_ok: bool = False,
) -> list[str]:
    """What differs between a stored config (with the runs it read, ``inputs``) and ``cfg`` today.

    ``stored_checkout``: the checkout the run ran in (its absolute paths compare relative to it);
    ``unknown_ok``: see :func:`inputs_changed`.
    """
    stored = migrate.config(dict(stored), added=True)[0]  # under today's names, with the options added since
    now = resolved(cfg)
    root = str(now.get("paths", {}).get("root", cfg.paths.root))
    stored_roots = {"outputs": str((stored.get("paths") or {}).get("root", "")), "checkout": stored_checkout}
    current_roots = {"outputs": root, "checkout": str(checkout)}
    return changes(stored, now, stored_roots, current_roots) + inputs_changed(inputs, Path(root), unknown_ok)


def stored_inputs(out_dir: Path) -> dict[str, str]:
    """The runs that ``out_dir`` read (its metrics' ``inputs``, ``provenance.Inputs``).

    Empty while the run is unfinished or its metrics are damaged: the run itself redoes what it must.
    """
    try:
        inputs = json.loads((Path(out_dir) / "metrics.json").read_text(encoding="utf-8")).get("inputs") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return dict(inputs)


def inputs_changed(inputs: Mapping[str, str], root: Path, unknown_ok: bool = False) -> list[str]:
    """``input <run>: <DONE then> -> <DONE now>`` for each of ``inputs`` that was redone since.

    ``inputs``: run folder (absolute, or under ``root``) -> the ``DONE`` stamp it was read at; each is looked
    up as a run folder here, else as a run record. One found nowhere counts as changed unless ``unknown_ok``.
    """
    found = []
    for ref, stamp in sorted(inputs.items()):
        now = done_stamp(Path(ref) if Path(ref).is_absolute() else Path(root) / ref)
        if now is None and unknown_ok:
            continue
        if now != stamp:
            found.append(f"input {ref}: finished {stamp} -> {ABSENT if now is None else 'redone ' + now}")
    return found


def check_run(out_dir: Path, cfg: DictConfig, checkout: Path) -> None:
    """Refuse a run folder made with other settings than ``cfg``, or from runs redone since, unless kept.

    A folder without a stored config passes: nothing ran there yet.

    Raises:
        KVResearchError: the differing settings, and the two ways on (``force=true``, ``on_config_change=keep``).
    """
    policy = str(cfg.get("on_config_change", "refuse"))
    if policy not in ON_CHANGE:
        raise KVResearchError(f"on_config_change={policy} is not one of {', '.join(ON_CHANGE)}.")
    found = run_changes(out_dir, cfg, checkout)
    if not found:
        return
    shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
    if policy == "keep":
        print(f"[kvresearch] {out_dir} was made with other settings ({shown}); keeping it (on_config_change=keep)")
        return
    raise KVResearchError(
        f"The run folder {out_dir} was made with other settings than this command's ({len(found)} differ, "
        f"stored -> now: {shown}). A folder is named by the command-line overrides only, so a default changed "
        "in conf/ since, a setting added since, or a run it read redone since under the same name all land in "
        "the same folder. Redo the run with force=true (it empties the folder), or keep it as it is with "
        "on_config_change=keep (a finished run is reused, an unfinished one resumes under the new settings)."
    )


def folder_changes(folder: Path, stage: str, overrides: list[str]) -> list[str]:
    """What differs between a run folder's stored config and the one ``overrides`` compose today ([] if none).

    For runners that skip finished runs without starting their stage (:mod:`kvresearch.experiment`).
    """
    if not (Path(folder) / "config.yaml").is_file():
        return []
    return run_changes(folder, today(stage, overrides), repo_root()) or []


def record_changes(record: dict[str, Any], stage: str, overrides: list[str]) -> list[str]:
    """What differs between a run record's config and the one ``overrides`` compose today (``key: stored -> now``).

    Also each run it read that was redone since, found as a run folder here or as a record (one found nowhere,
    such as a surrogate trained on the machine that ran it, is not checked).
    """
    stored_checkout = str(record["versions"].get("checkout") or repo_root())
    inputs = record["metrics"].get("inputs") or {}
    now = today(stage, overrides)
    return stored_changes(record["config"], stored_checkout, inputs, now, repo_root(), unknown_ok=True)
