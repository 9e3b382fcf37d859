"""Stage ``train_surrogate``: fit a KVzap surrogate on an extract run, measure it on held-out documents.

``python -m kvresearch.stages.train_surrogate surrogate=mlp`` (``make train-surrogate`` trains both);
the extract run is ``paths.extract`` (a run folder or id). Writes ``export/`` (what KVzap methods load),
``kvpress/`` (kvpress's KVzapModel layout), the held-out fit metrics and ``r2_per_layer.png``
(``kvresearch/surrogate/training.py`` does the work).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvresearch.runs import RunContext, resolve_run, stage_main
from kvresearch.surrogate.data import ExtractRun
from kvresearch.surrogate.modules import Surrogate
from kvresearch.surrogate.training import Training, train_surrogate


def run(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """Fit, export, and score on the extract run's test documents."""
    data = ExtractRun(ctx.inputs.add(resolve_run(cfg.paths.extract, "extract", cfg.paths.root)))
    recipe, trainer = (OmegaConf.to_container(c, resolve=True) for c in (cfg.surrogate, cfg.trainer))
    training = Training(recipe, trainer, int(cfg.seed), int(cfg.checkpoint_every_n_steps))  # type: ignore[arg-type]
    return train_surrogate(data, training, ctx.out_dir, ctx.tracker)


def verify(out_dir: Path) -> None:
    """A finished run must still hold a loadable export."""
    Surrogate.load(out_dir / "export")


main = stage_main("train_surrogate", run, verify)

if __name__ == "__main__":
    main()
