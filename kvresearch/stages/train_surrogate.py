"""Stage ``train_surrogate``: fit a KVzap surrogate on an extract run, measure it on held-out documents.

``python -m kvresearch.stages.train_surrogate surrogate=mlp`` (``make train-surrogate`` trains both)

* ``surrogate.fit=sgd``: Lightning, MSE, AdamW, cosine schedule, gradient clipping (checkpoints in
  ``ckpt/``; a re-run resumes from ``ckpt/last.ckpt``);
* ``surrogate.fit=ridge``: the closed-form per-layer ridge of the reference (linear only).

Writes ``export/`` (our safetensors + JSON, what the KVzap method loads), ``kvpress/`` (kvpress's
KVzapModel layout), ``metrics.json`` with the fit metrics on the corpus's test documents, and
``r2_per_layer.png``.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from kvresearch.errors import KVResearchError
from kvresearch.ops.ridge import RidgeAccumulator
from kvresearch.runs import RunContext, stage_main
from kvresearch.surrogate.data import ExtractRun, predict
from kvresearch.surrogate.export import to_kvpress
from kvresearch.surrogate.lightning import ShardDataModule, SurrogateModule, TrackerLogger
from kvresearch.surrogate.metrics import fit_metrics
from kvresearch.surrogate.modules import Surrogate, SurrogateConfig


def fit_ridge(surrogate: Surrogate, run: ExtractRun, rows: np.ndarray, alpha: float, batch: int = 8192) -> None:
    if surrogate.config.kind != "linear":
        raise KVResearchError("surrogate.fit=ridge fits the linear surrogate only; use surrogate.fit=sgd for mlp.")
    acc = RidgeAccumulator(surrogate.config.layers, surrogate.config.hidden, surrogate.config.kv_heads)
    for start in range(0, len(rows), batch):
        acc.update(*run.fetch(rows[start : start + batch]))
    weights, bias = acc.solve(alpha)
    with torch.no_grad():
        surrogate.weights[0].copy_(weights)
        surrogate.biases[0].copy_(bias)


def fit_sgd(surrogate: Surrogate, run: ExtractRun, cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    s = cfg.surrogate
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no banner lines per run
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    data = ShardDataModule(run, s.batch_size, s.val_fraction, cfg.seed)
    module = SurrogateModule(surrogate, s.lr, s.weight_decay, s.epochs)
    ckpt_dir = ctx.out_dir / "ckpt"
    trainer = L.Trainer(
        max_epochs=s.epochs,
        gradient_clip_val=s.grad_clip,
        default_root_dir=str(ctx.out_dir),
        logger=TrackerLogger(ctx.tracker),
        callbacks=[ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True, save_top_k=0)],
        enable_progress_bar=sys.stderr.isatty(),
        enable_model_summary=False,
        **OmegaConf.to_container(cfg.trainer, resolve=True),  # type: ignore[arg-type]
    )
    resume = ckpt_dir / "last.ckpt"
    trainer.fit(module, datamodule=data, ckpt_path=str(resume) if resume.is_file() else None)
    return {
        "val_mse": float(trainer.callback_metrics.get("val/mse", float("nan"))),
        "train_mse": float(trainer.callback_metrics.get("train/mse", float("nan"))),
    }


def plot_r2(r2_per_layer: list[float], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.bar(range(len(r2_per_layer)), r2_per_layer)
    ax.set(xlabel="layer", ylabel="held-out R^2", title=title, ylim=(min(0.0, *r2_per_layer), 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    data = ExtractRun(cfg.extract_dir)
    layout = data.layout
    config = SurrogateConfig(
        cfg.surrogate.kind, layout["layers"], layout["hidden"], layout["kv_heads"], model=data.model
    )
    torch.manual_seed(cfg.seed)
    surrogate = Surrogate(config)
    documents = data.split_documents(cfg.surrogate.val_fraction, cfg.seed)
    if not documents["test"]:
        raise KVResearchError(f"The extract run {data.folder} has no test documents; raise corpus.n_test_per_source.")
    start = time.perf_counter()
    if cfg.surrogate.fit == "ridge":
        fit_ridge(surrogate, data, data.rows_of(documents["train"] | documents["val"]), cfg.surrogate.alpha)
        training: dict[str, Any] = {}
    elif cfg.surrogate.fit == "sgd":
        training = fit_sgd(surrogate, data, cfg, ctx)
    else:
        raise KVResearchError(f"surrogate.fit must be 'sgd' or 'ridge', got {cfg.surrogate.fit!r}")
    train_s = time.perf_counter() - start
    surrogate.eval()
    surrogate.save(ctx.out_dir / "export")
    to_kvpress(surrogate, ctx.out_dir / "kvpress")

    truth, pred = predict(surrogate, data, data.rows_of(documents["test"]))
    fit = fit_metrics(truth, pred)
    plot_r2(
        fit["r2_per_layer"],
        f"{config.kind} surrogate, {data.model}: mean R^2 {fit['r2_mean']:.3f}",
        ctx.out_dir / "r2_per_layer.png",
    )
    print(
        f"[train_surrogate] {config.kind}/{cfg.surrogate.fit}: held-out R^2 mean {fit['r2_mean']:.3f} "
        f"(pooled {fit['r2_pooled']:.3f}), Spearman {fit['spearman_mean']:.3f}, precision {fit['precision']:.3f}, "
        f"recall {fit['recall']:.3f}, {train_s:.0f} s"
    )
    ctx.tracker.log({"test/r2_mean": fit["r2_mean"], "test/spearman_mean": fit["spearman_mean"]})
    return {
        "kind": config.kind,
        "fit": cfg.surrogate.fit,
        "model": data.model,
        "train_s": train_s,
        "documents": {k: len(v) for k, v in documents.items()},
        "rows": {k: len(data.rows_of(v)) for k, v in documents.items()},
        "flops_per_token_per_layer": surrogate.flops_per_token(),
        **training,
        "test": fit,
    }


main = stage_main("train_surrogate", run)

if __name__ == "__main__":
    main()
