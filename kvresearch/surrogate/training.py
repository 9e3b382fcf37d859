"""Fitting a surrogate on an extract run: closed-form ridge, or Lightning with resumable checkpoints.

* ``fit=ridge``: the closed-form per-layer ridge of the reference (linear only), from streamed float64
  sufficient statistics;
* ``fit=sgd``: Lightning, MSE, AdamW, cosine schedule, gradient clipping; ``ckpt/last.ckpt`` is written
  every ``checkpoint_every_n_steps`` steps and every epoch, and a re-run resumes from it to the same result.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from omegaconf import OmegaConf

from kvresearch.errors import KVResearchError
from kvresearch.models import ModelAdapter, load_model
from kvresearch.ops.ridge import RidgeAccumulator
from kvresearch.surrogate.data import ExtractRun, predict
from kvresearch.surrogate.export import kvpress_loads, to_kvpress
from kvresearch.surrogate.lightning import Checkpoints, ShardDataModule, SurrogateModule, TrackerLogger
from kvresearch.surrogate.metrics import fit_metrics
from kvresearch.surrogate.modules import Surrogate, SurrogateConfig
from kvresearch.tracking import Tracker


def fit_ridge(surrogate: Surrogate, run: ExtractRun, rows: np.ndarray, alpha: float, batch: int = 8192) -> None:
    """Set the linear surrogate's weights to the ridge solution on ``rows``."""
    if surrogate.config.kind != "linear":
        raise KVResearchError("surrogate.fit=ridge fits the linear surrogate only; use surrogate.fit=sgd for mlp.")
    acc = RidgeAccumulator(surrogate.config.layers, surrogate.config.inputs, surrogate.config.kv_heads)
    for start in range(0, len(rows), batch):
        acc.update(*run.fetch(rows[start : start + batch]))
    weights, bias = acc.solve(alpha)
    with torch.no_grad():
        surrogate.weights[0].copy_(weights)
        surrogate.biases[0].copy_(bias)


def _checkpoint_to_resume(path: Path) -> int | None:
    """The global step of the checkpoint at ``path``, None if there is none; raise naming it if it is damaged."""
    if not path.is_file():
        return None
    try:
        return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])
    except Exception as error:  # torch raises several types for a damaged file
        raise KVResearchError(
            f"The checkpoint {path} cannot be read ({type(error).__name__}: {str(error)[:120]}); it is damaged or "
            "truncated. Delete it to train this run from the start (or re-run with force=true)."
        ) from error


@dataclass
class Training:
    """How to train: a recipe, extra Trainer arguments, the seed, the checkpoint interval.

    ``recipe`` is a ``conf/surrogate/`` config; ``trainer`` extra ``lightning.Trainer`` keyword arguments;
    ``every_n_steps`` the checkpoint interval in optimizer steps (0: only at epoch ends).
    """

    recipe: Mapping[str, Any]
    trainer: Mapping[str, Any]
    seed: int
    every_n_steps: int


def fit_sgd(surrogate: Surrogate, run: ExtractRun, t: Training, out_dir: Path, tracker: Tracker) -> dict[str, Any]:
    """Train with Lightning, resuming from ``out_dir/ckpt/last.ckpt``; the final train and validation MSE."""
    recipe, seed = t.recipe, t.seed
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no banner lines per run
    L.seed_everything(seed, workers=True, verbose=False)
    data = ShardDataModule(run, int(recipe["batch_size"]), float(recipe["val_fraction"]), seed)
    targets = run.target_moments(data.train_rows) if recipe.get("standardize_targets", False) else None
    module = SurrogateModule(surrogate, float(recipe["lr"]), float(recipe["weight_decay"]), int(recipe["epochs"]),
                             targets)  # fmt: skip
    last = out_dir / "ckpt" / "last.ckpt"
    trainer = L.Trainer(
        max_epochs=int(recipe["epochs"]),
        gradient_clip_val=float(recipe["grad_clip"]),
        default_root_dir=str(out_dir),
        logger=TrackerLogger(tracker),
        callbacks=[Checkpoints(last, t.every_n_steps)],
        enable_checkpointing=False,
        enable_progress_bar=sys.stderr.isatty(),
        enable_model_summary=False,
        **{"use_distributed_sampler": False, **dict(t.trainer)},  # processes slice the batches themselves
    )
    resumed_from = _checkpoint_to_resume(last)
    trainer.fit(module, datamodule=data, ckpt_path=str(last) if resumed_from is not None else None)
    if targets is not None:
        surrogate.rescale_output(*targets)
    surrogate.eval()
    mse = {
        split: float(np.mean((truth - pred) ** 2))
        for split, rows in (("train", data.train_rows), ("val", data.val_rows))
        for truth, pred in [predict(surrogate, run, rows)]
        if len(rows)
    }
    training = {"train_mse": mse.get("train"), "val_mse": mse.get("val"), "resumed_from_step": resumed_from}
    return {**training, "processes": trainer.world_size}


def plot_r2(r2_per_layer: list[float], title: str, path: Path) -> None:
    """Bar chart of the held-out R^2 per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar(range(len(r2_per_layer)), r2_per_layer)
    ax.set(xlabel="layer", ylabel="held-out R^2", title=title, ylim=(min(0.0, *r2_per_layer), 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_context(data: ExtractRun, context: Sequence[str]) -> int:
    """Give ``data``'s rows the ``context`` columns, computed with the extract's own model; its query heads.

    Nothing to do (0) for a surrogate of h alone.
    """
    if not context:
        return 0
    loaded = load_model(OmegaConf.load(data.folder / "config.yaml").model)
    adapter = ModelAdapter(loaded.model)
    data.add_context(tuple(context), adapter, loaded.tokenizer)
    return adapter.num_heads


def train_surrogate(data: ExtractRun, t: Training, out_dir: Path, tracker: Tracker) -> dict[str, Any]:
    """Fit a surrogate, export it (ours and kvpress's) and score it on the test documents; the run's metrics."""
    recipe, seed, layout = t.recipe, t.seed, data.layout
    kind, fit = str(recipe["kind"]), str(recipe["fit"])
    width = recipe.get("mlp_hidden")  # the MLP's hidden width (None: hidden / 8, the reference)
    config = SurrogateConfig(kind, layout["layers"], layout["hidden"], layout["kv_heads"],
                             mlp_hidden=None if width is None else int(width), model=data.model,
                             mlp_layers=int(recipe.get("mlp_layers") or 1), context=tuple(recipe.get("context") or ()),
                             q_heads=add_context(data, recipe.get("context") or ()))  # fmt: skip
    torch.manual_seed(seed)
    surrogate = Surrogate(config)
    documents = data.split_documents(float(recipe["val_fraction"]), seed)
    if not documents["test"]:
        raise KVResearchError(f"The extract run {data.folder} has no test documents; raise corpus.n_test_per_source.")
    start = time.perf_counter()
    if fit == "ridge":
        fit_ridge(surrogate, data, data.rows_of(documents["train"] | documents["val"]), float(recipe["alpha"]))
        training: dict[str, Any] = {}
    elif fit == "sgd":
        training = fit_sgd(surrogate, data, t, out_dir, tracker)
    else:
        raise KVResearchError(f"surrogate.fit must be 'sgd' or 'ridge', got {fit!r}")
    train_s = time.perf_counter() - start
    surrogate.eval().save(out_dir / "export")
    if kvpress_loads(surrogate):
        to_kvpress(surrogate, out_dir / "kvpress")
    else:
        print(
            "[train_surrogate] no kvpress export: kvpress's KVzapModel reads h alone through at most one hidden layer"
        )
    scores = fit_metrics(*predict(surrogate, data, data.rows_of(documents["test"])))
    title = f"{kind} surrogate, {data.model}: mean R^2 {scores['r2_mean']:.3f}"
    plot_r2(scores["r2_per_layer"], title, out_dir / "r2_per_layer.png")
    print(
        f"[train_surrogate] {kind}/{fit}: held-out R^2 mean {scores['r2_mean']:.3f} (pooled "
        f"{scores['r2_pooled']:.3f}), Spearman {scores['spearman_mean']:.3f}, precision {scores['precision']:.3f}, "
        f"recall {scores['recall']:.3f}, {train_s:.0f} s"
    )
    tracker.log({"test/r2_mean": scores["r2_mean"], "test/spearman_mean": scores["spearman_mean"]})
    return {
        "kind": kind,
        "fit": fit,
        "model": data.model,
        "extract_run": str(data.folder),
        "train_s": train_s,
        "documents": {k: len(v) for k, v in documents.items()},
        "rows": {k: len(data.rows_of(v)) for k, v in documents.items()},
        "flops_per_token_per_layer": surrogate.flops_per_token(),
        **training,
        "test": scores,
    }
