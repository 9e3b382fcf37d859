"""Lightning wrappers: the training module, a resumable data module, periodic checkpoints, a logger bridge.

The module: MSE, AdamW, a per-epoch cosine schedule (the KVzap recipe).

A killed run resumes from ``last.ckpt`` (written every ``every_n_steps`` optimizer steps and at the end of
every epoch) with the same weights, optimizer, schedule and data order, so it ends where an uninterrupted
run ends: the data module's state (the order's generator and the batches trained on) goes into the
checkpoint, and the training loader skips what was already trained on.

Several processes (``trainer.strategy=ddp`` / ``ddp_spawn``, ``trainer.devices=N``): every process walks the
same global order and takes its 1/N slice of each batch (:class:`RankSlices`), so the averaged gradient is
the single process's (equal when N divides each batch) and resuming works as with one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from torch import nn
from torch.utils.data import DataLoader, Sampler

from kvresearch.surrogate.data import ExtractRun, Rows, ShuffledBatches, _as_is, loader
from kvresearch.surrogate.modules import Surrogate
from kvresearch.tracking import Tracker


class SurrogateModule(L.LightningModule):
    """MSE regression of log KVzip+; AdamW with a per-epoch cosine schedule (the KVzap recipe).

    With ``targets`` (mean, std), each (layers, kv_heads), the surrogate learns the standardized targets
    ``(y - mean) / std`` (the logged MSE is in those units); :meth:`Surrogate.rescale_output` folds the
    moments back after training. Weight decay then pulls the output towards the targets' mean, not towards 0
    (on a random model the targets sit near -11 with a spread of a few hundredths).
    """

    def __init__(self, surrogate: Surrogate, lr: float, weight_decay: float, epochs: int,
                 targets: tuple[torch.Tensor, torch.Tensor] | None = None):  # fmt: skip
        super().__init__()
        self.surrogate = surrogate
        self.lr, self.weight_decay, self.epochs = lr, weight_decay, epochs
        mean, std = targets if targets is not None else (torch.zeros(()), torch.ones(()))
        self.register_buffer("target_mean", mean, persistent=False)
        self.register_buffer("target_std", std, persistent=False)

    def _standardized(self, y: torch.Tensor) -> torch.Tensor:
        mean, std = self.get_buffer("target_mean"), self.get_buffer("target_std")
        return (y - mean) / std

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """The surrogate's predictions."""
        return self.surrogate(h)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        """MSE of a batch."""
        h, y = batch
        loss = nn.functional.mse_loss(self.surrogate(h), self._standardized(y))
        self.log("train/mse", loss, on_step=False, on_epoch=True, batch_size=len(h), sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        """Log the validation MSE."""
        h, y = batch
        mse = nn.functional.mse_loss(self.surrogate(h), self._standardized(y))
        self.log("val/mse", mse, on_epoch=True, batch_size=len(h), sync_dist=True)

    def configure_optimizers(self) -> Any:
        """AdamW with a per-epoch cosine schedule."""
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.epochs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "epoch"}}


class RankSlices(Sampler[list[int]]):
    """This process's share of each global batch: rows ``rank::world`` (all of it with one process)."""

    def __init__(self, order: ShuffledBatches, rank: int, world: int):
        """Slice ``order``'s batches for process ``rank`` of ``world``."""
        self.order, self.rank, self.world = order, rank, world

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.order:
            yield batch[self.rank :: self.world]


class ResumableLoader(DataLoader):
    """The training loader; its state is its data module's (Lightning restores it on a mid-epoch restart)."""

    def __init__(self, data: ShardDataModule, rank: int = 0, world: int = 1):
        """Batches (this process's slice of each) of ``data``'s training rows in its resumable order."""
        batches = RankSlices(data.order, rank, world)
        super().__init__(Rows(data.run, data.train_rows), batch_sampler=batches, collate_fn=_as_is)
        self.data = data

    def state_dict(self) -> dict[str, Any]:
        """The data module's state."""
        return self.data.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the data module's state."""
        self.data.load_state_dict(state)


class ShardDataModule(L.LightningDataModule):
    """Train / validation rows of an extract run, split by document; the training order is resumable."""

    def __init__(self, run: ExtractRun, batch_size: int, val_fraction: float, seed: int):
        """Split ``run``'s documents and prepare the seeded order of the training rows."""
        super().__init__()
        self.run, self.batch_size, self.seed = run, batch_size, seed
        self.documents = run.split_documents(val_fraction, seed)
        self.train_rows = run.rows_of(self.documents["train"])
        self.val_rows = run.rows_of(self.documents["val"])
        self.order = ShuffledBatches(len(self.train_rows), batch_size, seed)

    def train_dataloader(self) -> Any:
        """Training batches in the resumable order (this process's slice of each)."""
        trainer = self.trainer
        return ResumableLoader(self, trainer.global_rank, trainer.world_size) if trainer else ResumableLoader(self)

    def val_dataloader(self) -> Any:
        """Validation batches in order."""
        return loader(Rows(self.run, self.val_rows), 4 * self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """The order's state after the batches of this epoch the trainer has taken (trained on, at a checkpoint)."""
        trainer = self.trainer
        consumed = trainer.fit_loop.epoch_loop.batch_progress.current.ready if trainer is not None else None
        return {"order": self.order.state_dict(consumed)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the order where the checkpoint left it."""
        self.order.load_state_dict(state_dict["order"])


class Checkpoints(Callback):
    """Write ``path`` every ``every_n_steps`` optimizer steps (0: never) and at the end of every epoch."""

    def __init__(self, path: Path, every_n_steps: int):
        """Checkpoint to ``path``."""
        self.path, self.every_n_steps = Path(path), int(every_n_steps)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        """Save on every ``every_n_steps``-th step."""
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            trainer.save_checkpoint(self.path)

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """Save at the end of the epoch."""
        trainer.save_checkpoint(self.path)


class TrackerLogger(Logger):
    """Sends Lightning's metrics to the job's tracker, so one job keeps one W&B run."""

    def __init__(self, tracker: Tracker):
        super().__init__()
        self.tracker = tracker

    @property
    def name(self) -> str:
        """Logger name."""
        return "kvresearch"

    @property
    def version(self) -> str:
        """Logger version."""
        return "0"

    @property
    @rank_zero_experiment
    def experiment(self) -> Tracker:
        """The job's tracker."""
        return self.tracker

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Forward to the tracker."""
        self.tracker.log(metrics, step=step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """The run's config is already recorded in config.yaml and in the tracker."""
