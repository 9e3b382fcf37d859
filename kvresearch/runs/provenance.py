"""What a run was made from.

Package versions, the commit (and the diff, if the tree was dirty), and the finished runs it read
(:class:`Inputs`), so a later run can tell when one of them was redone since.
"""

from __future__ import annotations

import hashlib
import platform
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from kvresearch.errors import KVResearchError
from kvresearch.runs.naming import repo_root
from kvresearch.runs.records import done_stamp

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
MAX_DIFF = 200_000  # characters of a dirty tree's diff kept in versions.json (its sha1 is always kept)


def _git(*args: str) -> str | None:
    """The output of ``git <args>`` in the checkout, or None when git fails."""
    try:
        done = subprocess.run(["git", "-C", str(repo_root()), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """``commit``, ``dirty`` and, for a dirty tree, ``diff_sha1`` and ``diff``.

    The diff is against HEAD, untracked files listed by name; all None outside a git checkout.
    """
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None}
    status = _git("status", "--porcelain") or ""
    state: dict[str, Any] = {"commit": commit.strip(), "dirty": bool(status.strip())}
    if state["dirty"]:
        untracked = [line[3:] for line in status.splitlines() if line.startswith("??")]
        diff = (_git("diff", "HEAD") or "") + "".join(f"untracked: {name}\n" for name in untracked)
        state["diff_sha1"] = hashlib.sha1(diff.encode()).hexdigest()
        state["diff"] = diff if len(diff) <= MAX_DIFF else None
    return state


def versions() -> dict[str, Any]:
    """Package versions, Python, platform, the git state (:func:`git_state`) and the checkout's folder."""
    packages: dict[str, str | None] = {}
    for name in TRACKED_PACKAGES:
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    return {
        "packages": packages,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git": git_state(),
        "checkout": str(repo_root()),  # absolute paths in config.yaml compare relative to it (runs.changes)
    }


class Inputs:
    """The finished runs one run reads: folder (relative to the outputs root) -> the ``DONE`` stamp read.

    The runner makes one per run (``RunContext.inputs``) and keeps it in the run's metrics (``inputs``); the
    stage adds each run it reads (:meth:`add`), so nothing one run read leaks into another's record.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.found: dict[str, str] = {}

    def add(self, folder: str | Path) -> Path:
        """Note the finished run ``folder`` (its ``DONE`` stamp, or its run record's) and return it.

        Raises:
            KVResearchError: ``folder`` is neither a finished run nor recorded.
        """
        folder = Path(folder).resolve()
        stamp = done_stamp(folder)
        if stamp is None:
            raise KVResearchError(f"{folder} is not a finished run (no DONE, no run record): run it first.")
        key = str(folder.relative_to(self.root)) if folder.is_relative_to(self.root) else str(folder)
        self.found[key] = stamp
        return folder

    def add_all(self, folders: Iterable[str | Path]) -> None:
        """Note each of ``folders`` (:meth:`add`)."""
        for folder in folders:
            self.add(folder)

    def as_dict(self) -> dict[str, str]:
        """The noted runs, sorted by folder."""
        return dict(sorted(self.found.items()))
