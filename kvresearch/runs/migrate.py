"""Renamed options: stored configs, run folders and run records brought to today's names.

A rename does not change what a run computes, so a run made under the old names is still a finished cell:
:func:`config` maps a stored config to today's layout (the change check compares that, not the raw file),
and ``python -m kvresearch.experiment migrate`` renames run folders (from their Hydra overrides) and run
records (from the cells of the experiments) whose names hold a renamed override. Each rename is listed in
:data:`RENAMES`; a migrated record names the ones applied (``migrated``).

* ``kvzap-calibrate``: KVzap's ``calibrate_to`` (a share pruned) became ``calibrate: true`` with
  ``keep_ratio`` (the share kept, as every other method's budget); the threshold a keep ratio clears is null.
* ``am-groups``: Attention Matching's flat options became four groups (``queries``, ``keys``, ``fit``,
  ``budgets``; ``methods/am_options.py``).
* ``decoding-type``: KVzap's ``decoding: false`` became ``null``, as for every method.

Options added since, with the value that computes what runs made before them computed (:data:`ADDED`),
are filled in for the change check only (``added=True``): an added option renames nothing, so files keep them out.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

RENAMES = ("kvzap-calibrate", "am-groups", "decoding-type")
# method class (suffix of _target_) -> option -> the value that computes what runs made before it computed
ADDED: dict[str, dict[str, Any]] = {
    ".KVzap": {"sinks": 0, "reduction": "max", "page_size": 1},
    ".KVPress": {"sinks": 0, "scope": "head", "reduction": "max"},
    ".KVzip": {"reduction": "max", "page_size": 1},
}
AM_GROUPS = {  # old flat option -> (group, new name)
    "queries": ("queries", "sources"),
    "self_study": ("queries", "self_study"),
    "on_policy": ("queries", "on_policy"),
    "max_queries": ("queries", "max_per_head"),
    "holdout": ("queries", "holdout"),
    "seed": ("queries", "seed"),
    "keys": ("keys", "select"),
    "reduce": ("keys", "reduce"),
    "omp_keys_per_step": ("keys", "per_step"),
    "omp_refit_every": ("keys", "refit_every"),
    "omp_drop_below": ("keys", "drop_below"),
    "omp_progressive": ("keys", "progressive"),
    "fit_beta": ("fit", "beta"),
    "fit_values": ("fit", "values"),
    "ridge": ("fit", "ridge"),
    "beta_bounds": ("fit", "beta_bounds"),
    "work_dtype": ("fit", "work_dtype"),
    "budgets": ("budgets", "heads"),
    "span": ("budgets", "span"),
    "chunk_tokens": ("budgets", "chunk_tokens"),
}


def keep_of(prune: Any) -> float:
    """The share kept for a share pruned, rounded as tables print it."""
    return round(1.0 - float(prune), 10)


def _flat(key: str, value: Any) -> bool:
    """Whether an AM option is in the old flat layout (old budgets could be a budgets run's ``_target_`` node)."""
    return key in AM_GROUPS and (not isinstance(value, dict) or (key == "budgets" and "_target_" in value))


def _method(node: Any, applied: list[str], added: bool = False) -> Any:
    """One method node (a mapping with ``_target_``; nested ``then`` methods too) in today's layout."""
    if not isinstance(node, dict):
        return node
    target = str(node.get("_target_", ""))
    if "then" in node:
        node["then"] = _method(node["then"], applied, added)
    for suffix, defaults in ADDED.items():
        if added and target.endswith(suffix):
            for option, before in defaults.items():
                node.setdefault(option, before)
    if target.endswith(".KVzap"):
        if node.get("calibrate_to") is not None:
            node["calibrate"], node["keep_ratio"], node["threshold"] = True, keep_of(node["calibrate_to"]), None
            applied.append("kvzap-calibrate")
        if "calibrate_to" in node:
            node.pop("calibrate_to")
            node.setdefault("calibrate", False)
        if node.get("decoding") is False:
            node["decoding"] = None
            applied.append("decoding-type")
    if target.endswith(".AttentionMatching") and any(_flat(k, v) for k, v in node.items()):
        flat = {k: node.pop(k) for k, v in list(node.items()) if _flat(k, v)}
        for old, value in flat.items():
            group, new = AM_GROUPS[old]
            if old == "budgets" and value is None:
                value = "uniform"
            node.setdefault(group, {})[new] = value
        applied.append("am-groups")
    return node


def config(stored: dict[str, Any], added: bool = False) -> tuple[dict[str, Any], list[str]]:
    """``stored`` (a run's config) with renamed options under today's names, and the renames applied.

    ``added``: also fill in the options added since (:data:`ADDED`), as the change check compares them.
    """
    out, applied = copy.deepcopy(stored), list[str]()
    if isinstance(out.get("method"), dict):
        out["method"] = _method(out["method"], applied, added)
    return out, sorted(set(applied))


def overrides(old: Iterable[str]) -> list[str]:
    """Command-line overrides under today's names (``method.calibrate_to=0.75`` -> calibrate, keep_ratio=0.25)."""
    out = []
    for item in old:
        key, _, value = item.partition("=")
        if key == "method.calibrate_to":
            out += ["method.calibrate=true", f"method.keep_ratio={keep_of(value):g}"]
        elif key.startswith("method.") and key[len("method.") :] in AM_GROUPS:
            group, new = AM_GROUPS[key[len("method.") :]]
            out.append(f"method.{group}.{new}={value}")
        else:
            out.append(item)
    return out


def backward(new: Iterable[str]) -> list[str]:
    """The overrides a cell had before ``kvzap-calibrate`` (to find its old run folder or record)."""
    new = list(new)
    if "method.calibrate=true" not in new:
        return new
    out = [o for o in new if o != "method.calibrate=true" and not o.startswith("method.keep_ratio=")]
    keep = next(o.split("=", 1)[1] for o in new if o.startswith("method.keep_ratio="))
    return [*out, f"method.calibrate_to={keep_of(keep):g}"]
