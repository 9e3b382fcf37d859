"""The extract stage's output as training data: memory-mapped rows, split by document.

Splits: the corpus's test documents are the held-out set (never seen in training); the corpus's train
documents are divided by document into train and validation (``val_fraction``, seeded).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from kvresearch.data.shards import Shard, hidden_from_numpy, open_shard
from kvresearch.errors import KVResearchError


class ExtractRun:
    """A finished extract run folder: manifest, memory-mapped shards, row lookup."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        if not (self.folder / "DONE").is_file() or not (self.folder / "manifest.json").is_file():
            raise KVResearchError(
                f"No finished extract run at {self.folder} (expected manifest.json and DONE). Run `make extract` "
                "first, or point extract_dir at a finished extract run folder."
            )
        self.manifest: dict[str, Any] = json.loads((self.folder / "manifest.json").read_text())
        self.layout = self.manifest["layout"]
        self.shards: list[Shard] = [open_shard(self.folder / "shards" / s["name"]) for s in self.manifest["shards"]]
        expected = (self.layout["layers"], self.layout["hidden"])
        for spec, shard in zip(self.manifest["shards"], self.shards, strict=True):
            if shard.hidden.shape[1:] != expected or shard.scores.shape[1:] != (expected[0], self.layout["kv_heads"]):
                raise KVResearchError(
                    f"Shard {self.folder / 'shards' / spec['name']} holds hidden {shard.hidden.shape[1:]} and scores "
                    f"{shard.scores.shape[1:]}, but the manifest expects (layers, hidden) = {expected} and "
                    f"{self.layout['kv_heads']} KV heads: shards from another model were mixed in. Re-run extract "
                    "into an empty folder."
                )
        self.offsets = np.cumsum([0] + [len(s.doc) for s in self.shards])
        self.doc = np.concatenate([np.asarray(s.doc) for s in self.shards]) if self.shards else np.zeros(0, np.int32)

    @property
    def model(self) -> str:
        return str(self.manifest["model"])

    def split_documents(self, val_fraction: float, seed: int) -> dict[str, set[int]]:
        done = [d for d in self.manifest["documents"] if d["status"] == "done"]
        train = sorted(d["index"] for d in done if d["split"] == "train")
        random.Random(seed).shuffle(train)
        n_val = max(1, round(val_fraction * len(train))) if len(train) > 1 else 0
        return {
            "train": set(train[n_val:]),
            "val": set(train[:n_val]),
            "test": {d["index"] for d in done if d["split"] == "test"},
        }

    def rows_of(self, documents: set[int]) -> np.ndarray:
        """Global row indices of the given documents, ascending."""
        return np.flatnonzero(np.isin(self.doc, np.fromiter(documents, dtype=np.int64)))

    def fetch(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """h (n, layers, hidden) float32 and y (n, layers, kv_heads) float32 for global ``rows`` (any order)."""
        rows = np.sort(np.asarray(rows))
        which = np.searchsorted(self.offsets, rows, side="right") - 1
        hs, ys = [], []
        for s in np.unique(which):
            local = rows[which == s] - self.offsets[s]
            shard = self.shards[s]
            hs.append(hidden_from_numpy(shard.hidden[local], self.layout["hidden_dtype"]).float())
            ys.append(torch.from_numpy(np.ascontiguousarray(shard.scores[local])))
        return torch.cat(hs), torch.cat(ys)


class Rows(Dataset):
    """Rows of an extract run; batched access through ``__getitems__`` (one fancy index per shard)."""

    def __init__(self, run: ExtractRun, rows: np.ndarray):
        self.run, self.rows = run, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        h, y = self.run.fetch(self.rows[[i]])
        return h[0], y[0]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run.fetch(self.rows[indices])


def loader(dataset: Rows, batch_size: int, shuffle: bool, seed: int = 0) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, collate_fn=lambda batch: batch, generator=generator
    )


def predict(
    module: torch.nn.Module, run: ExtractRun, rows: np.ndarray, batch_size: int = 4096
) -> tuple[np.ndarray, np.ndarray]:
    """Truth and prediction (rows, layers, kv_heads) for ``rows`` in ascending order."""
    truth, pred = [], []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            h, y = run.fetch(rows[start : start + batch_size])
            truth.append(y.numpy())
            pred.append(module(h).float().numpy())
    return np.concatenate(truth), np.concatenate(pred)
