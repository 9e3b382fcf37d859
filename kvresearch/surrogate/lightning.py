"""Lightning wrappers: the training module (MSE, AdamW, cosine schedule), the data module, a logger bridge."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from torch import nn

from kvresearch.surrogate.data import ExtractRun, Rows, loader
from kvresearch.surrogate.modules import Surrogate
from kvresearch.tracking import Tracker


class SurrogateModule(L.LightningModule):
    """MSE regression of log KVzip+; AdamW with a per-epoch cosine schedule (the KVzap recipe)."""

    def __init__(self, surrogate: Surrogate, lr: float, weight_decay: float, epochs: int):
        super().__init__()
        self.surrogate = surrogate
        self.lr, self.weight_decay, self.epochs = lr, weight_decay, epochs

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.surrogate(h)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        h, y = batch
        loss = nn.functional.mse_loss(self.surrogate(h), y)
        self.log("train/mse", loss, on_step=False, on_epoch=True, batch_size=len(h))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        h, y = batch
        self.log("val/mse", nn.functional.mse_loss(self.surrogate(h), y), on_epoch=True, batch_size=len(h))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.epochs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}


class ShardDataModule(L.LightningDataModule):
    """Train / validation rows of an extract run, split by document."""

    def __init__(self, run: ExtractRun, batch_size: int, val_fraction: float, seed: int):
        super().__init__()
        self.run, self.batch_size, self.seed = run, batch_size, seed
        self.documents = run.split_documents(val_fraction, seed)
        self.train_rows = run.rows_of(self.documents["train"])
        self.val_rows = run.rows_of(self.documents["val"])

    def train_dataloader(self) -> Any:
        return loader(Rows(self.run, self.train_rows), self.batch_size, shuffle=True, seed=self.seed)

    def val_dataloader(self) -> Any:
        return loader(Rows(self.run, self.val_rows), 4 * self.batch_size, shuffle=False)


class TrackerLogger(Logger):
    """Sends Lightning's metrics to the job's tracker, so one job keeps one W&B run."""

    def __init__(self, tracker: Tracker):
        super().__init__()
        self.tracker = tracker

    @property
    def name(self) -> str:
        return "kvresearch"

    @property
    def version(self) -> str:
        return "0"

    @property
    @rank_zero_experiment
    def experiment(self) -> Tracker:
        return self.tracker

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.tracker.log(metrics, step=step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The run's config is already recorded in config.yaml and in the tracker."""
