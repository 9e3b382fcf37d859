"""Where runs live and what they are called: the outputs root, run names, run ids, the ``DONE`` marker.

A run folder is ``<outputs root>/<stage>/<name>``, the name being Hydra's ``override_dirname`` of the job's
command-line overrides (``conf/common.yaml``: sorted, the keys that do not change a result left out), so
a folder can be found from a stage and its overrides alone (:func:`run_folder`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path

from omegaconf import OmegaConf

PACKAGE_DIR = Path(__file__).resolve().parent.parent
CONF_DIR = PACKAGE_DIR.parent / "conf"
OUTPUTS_ENV = "KVRESEARCH_OUTPUTS"
MAX_NAME = 200  # file systems refuse names over 255 bytes
RUN_ID = re.compile(r"[0-9a-f]{8}")


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


@functools.cache
def excluded_keys() -> frozenset[str]:
    """The override keys Hydra leaves out of run names (``conf/common.yaml``, read once)."""
    common = OmegaConf.load(CONF_DIR / "common.yaml")
    return frozenset(common.hydra.job.config.override_dirname.exclude_keys)


def run_folder(root: Path, stage: str, overrides: Sequence[str]) -> Path:
    """The run folder Hydra gives ``overrides`` of ``stage`` (``conf/common.yaml``: sorted, excluded keys left out)."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in excluded_keys()]
    return Path(root) / stage / run_name(",".join(sorted(kept)))
