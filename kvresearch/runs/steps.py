"""Named steps: the runs an experiment makes for others to read.

An extract, a surrogate, the parts of a sharded extract: listed under ``variants.<variant>.steps`` of
``conf/experiment/<name>.yaml`` and referenced as ``<name>:<step>``.
A step names its run by stage and overrides, so a hand-off needs no run id.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from kvresearch.errors import KVResearchError
from kvresearch.runs.naming import CONF_DIR, run_folder


@dataclass(frozen=True)
class Step:
    """A named run of an experiment that other runs hand off to, referenced as ``<experiment>:<name>``.

    An extract, a surrogate, the parts of a sharded extract; a step with ``sweep`` is several runs.
    """

    name: str
    stage: str
    overrides: tuple[str, ...]

    def folder(self, root: Path) -> Path:
        """The run folder Hydra gives these overrides."""
        return run_folder(root, self.stage, self.overrides)


def steps(exp: DictConfig, variant: str) -> list[Step]:
    """The steps of a variant in their order, each swept step as one run per point (``name@key=value``)."""
    out = []
    for name, body in ((exp.variants.get(variant) or {}).get("steps") or {}).items():
        sweep = dict(body.get("sweep") or {})
        for values in itertools.product(*sweep.values()):
            point = [f"{k}={v}" for k, v in zip(sweep, values, strict=True)]
            label = str(name) + "".join(f"@{p}" for p in point)
            out.append(Step(label, str(body.stage), tuple(str(o) for o in [*(body.get("overrides") or []), *point])))
    return out


def step_run(name: str, step: str, root: Path) -> tuple[str, Path]:
    """The (stage, run folder) of the step ``step`` of experiment ``name``, whichever variant holds it.

    Raises:
        KVResearchError: no such experiment or step (a swept step's runs are named ``step@key=value``).
    """
    path = CONF_DIR / "experiment" / f"{name}.yaml"
    if not path.is_file():
        raise KVResearchError(f"No experiment '{name}' in conf/experiment/ (the run reference '{name}:{step}').")
    exp = OmegaConf.load(path)
    assert isinstance(exp, DictConfig)
    found = {s.name: s for variant in ("twin", "hub") for s in steps(exp, variant)}
    if step not in found:
        listing = ", ".join(found) or "none"
        raise KVResearchError(f"experiment {name} has no step '{step}'; its steps: {listing}.")
    return found[step].stage, found[step].folder(root)
