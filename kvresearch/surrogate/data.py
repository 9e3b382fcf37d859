"""The extract stage's output as training data: memory-mapped rows, split by document, in a resumable order.

Splits: the corpus's test documents are the held-out set (never seen in training); the corpus's train
documents are divided by document into train and validation (``val_fraction``, seeded). Opening a run
verifies every shard's checksums and rejects non-finite rows, naming the file.

A surrogate with ``context`` inputs reads h and its context columns: :meth:`ExtractRun.add_context` computes
them once for every row (from the model and the documents rebuilt from the run's own config), and
:meth:`ExtractRun.fetch` returns them after h from then on.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset, Sampler

from kvresearch.data.corpus import cap_documents, load_corpus
from kvresearch.data.shards import HIDDEN_DTYPES, Shard, hidden_from_numpy, open_shard
from kvresearch.errors import KVResearchError
from kvresearch.models.adapter import ModelAdapter
from kvresearch.progress import Progress
from kvresearch.runs import read_json
from kvresearch.surrogate.context import canonical, context_features, context_width, count_rates


class ExtractRun:
    """A finished extract run folder: manifest, memory-mapped shards, row lookup."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        if not (self.folder / "DONE").is_file():
            raise KVResearchError(
                f"No finished extract run at {self.folder} (no DONE). Run `make stage-extract` first, or point "
                "paths.extract at a finished extract run (folder or run id)."
            )
        fix = "Re-run extract on that run (no force needed): it rebuilds what is damaged."
        self.manifest: dict[str, Any] = read_json(self.folder / "manifest.json", fix)
        try:
            self.layout = self.manifest["layout"]
            names = [s["name"] for s in self.manifest["shards"]]
        except (KeyError, TypeError) as error:
            raise KVResearchError(f"{self.folder / 'manifest.json'} lacks {error}. {fix}") from error
        self.shards: list[Shard] = [open_shard(self.folder / "shards" / name, full=True) for name in names]
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
        self.context: torch.Tensor | None = None  # (rows, layers, columns) after add_context

    @property
    def stored_dtype(self) -> torch.dtype:
        """The dtype the shards store hidden states in (converting it to float32 is exact)."""
        return HIDDEN_DTYPES[self.layout.get("hidden_dtype", "bfloat16")]

    @property
    def model(self) -> str:
        """The model the run was extracted from."""
        return str(self.manifest["model"])

    def split_documents(self, val_fraction: float, seed: int) -> dict[str, set[int]]:
        """Document indices of train, validation (a seeded share of train) and test."""
        done = [d for d in self.manifest["documents"] if d["status"] == "done"]
        train = sorted(d["index"] for d in done if d["split"] == "train")
        random.Random(seed).shuffle(train)
        n_val = max(1, round(val_fraction * len(train))) if len(train) > 1 else 0
        return {
            "train": set(train[n_val:]),
            "val": set(train[:n_val]),
            "test": {d["index"] for d in done if d["split"] == "test"},
        }

    def document_ids(self, tokenizer: Any) -> dict[int, np.ndarray]:
        """Document index -> token ids (n,) of every finished document, rebuilt from the run's own config.

        Each rebuilt document is checked against the manifest's id: a packaged corpus that changed since the
        run is refused rather than paired with the wrong rows.
        """
        cfg = OmegaConf.load(self.folder / "config.yaml")
        docs = cap_documents(load_corpus(cfg.corpus, tokenizer, cfg.seed)[0], cfg.extract.max_docs)
        out = {}
        for entry in self.manifest["documents"]:
            i = entry["index"]
            doc = docs[i] if i < len(docs) else None
            if doc is None or doc.doc_id != entry["doc_id"]:
                raise KVResearchError(
                    f"The corpus that {self.folder / 'config.yaml'} builds today does not hold the manifest's document "
                    f"{i} ({entry['doc_id']}; rebuilt: {doc.doc_id if doc else 'none'}): the packaged corpus changed "
                    "since this extract. Context inputs need a fresh extract (`make stage-extract ARGS='force=true'`)."
                )
            if entry["status"] == "done":
                out[i] = np.asarray(tokenizer(doc.text, add_special_tokens=False).input_ids, np.int64)
        return out

    def add_context(self, names: list[str] | tuple[str, ...], adapter: ModelAdapter, tokenizer: Any) -> None:
        """Compute the context columns of every row once (float32); :meth:`fetch` appends them to h after this.

        Each document is one context, as a one-call prefill of it would be at inference: its rows' positions,
        count rates over the whole document, and its length.
        """
        names, self.context = canonical(names), None
        ids = self.document_ids(tokenizer) if "counts" in names else {}
        pos = torch.from_numpy(np.concatenate([np.asarray(s.pos) for s in self.shards]).astype(np.int64))
        context = torch.zeros(len(self.doc), self.layout["layers"], context_width(names, adapter.num_heads))
        done = [d for d in self.manifest["documents"] if d["status"] == "done"]
        bar = Progress(len(done), "context inputs", unit="doc")
        for entry in done:
            rows = torch.from_numpy(self.rows_of({entry["index"]}))
            h, _ = self.fetch(rows.numpy())
            where = pos[rows]
            rates = count_rates(ids[entry["index"]])[where] if ids else None
            for i in range(h.shape[1]):
                context[rows, i] = context_features(names, adapter, i, h[:, i], where, rates, int(entry["n_tokens"]))
            bar.update()
        bar.close()
        self.context = context

    def rows_of(self, documents: set[int]) -> np.ndarray:
        """Global row indices of the given documents, ascending."""
        return np.flatnonzero(np.isin(self.doc, np.fromiter(documents, dtype=np.int64)))

    def target_moments(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and standard deviation (layers, kv_heads), float32, of the targets of ``rows`` (scores only read).

        A standard deviation of 0 (constant targets) is reported as 1, so dividing by it is always safe.
        """
        rows = np.sort(np.asarray(rows))
        which = np.searchsorted(self.offsets, rows, side="right") - 1
        shape = (self.layout["layers"], self.layout["kv_heads"])
        total, squares = np.zeros(shape), np.zeros(shape)
        for s in np.unique(which):
            y = np.asarray(self.shards[s].scores[rows[which == s] - self.offsets[s]], dtype=np.float64)
            total += y.sum(0)
            squares += (y**2).sum(0)
        n = max(len(rows), 1)
        mean = total / n
        std = np.sqrt(np.maximum(squares / n - mean**2, 0.0))
        return torch.from_numpy(mean).float(), torch.from_numpy(np.where(std > 0, std, 1.0)).float()

    def fetch(self, rows: np.ndarray, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """H (n, layers, hidden) in ``dtype`` and y (n, layers, kv_heads) float32 for global ``rows`` (any order).

        ``stored_dtype``: H exactly as stored, at half the memory of float32 for a bfloat16 extract. After
        :meth:`add_context`, H is (n, layers, hidden + context columns).
        """
        rows = np.sort(np.asarray(rows))
        which = np.searchsorted(self.offsets, rows, side="right") - 1
        hs, ys = [], []
        for s in np.unique(which):
            local = rows[which == s] - self.offsets[s]
            shard = self.shards[s]
            hs.append(hidden_from_numpy(shard.hidden[local], self.layout["hidden_dtype"]).to(dtype))
            ys.append(torch.from_numpy(np.ascontiguousarray(shard.scores[local])))
        h = torch.cat(hs)
        if self.context is not None:
            h = torch.cat([h, self.context[torch.from_numpy(rows)].to(dtype)], -1)
        return h, torch.cat(ys)


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


def _as_is(batch: Any) -> Any:
    return batch


def loader(dataset: Rows, batch_size: int) -> DataLoader:
    """Batches in order (validation, prediction)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=_as_is)


class ShuffledBatches(Sampler[list[int]]):
    """Batches of a seeded shuffle that a checkpoint can stop and resume mid-epoch.

    Epoch e yields what ``DataLoader(dataset, batch_size, shuffle=True, generator=manual_seed(seed))``
    yields in epoch e: the same draws from one generator (the loader's base seed, then RandomSampler's
    permutation and its second, empty, one), so the data order of the original recipe is kept. Its
    state is the generator at the start of the epoch in progress and the batches already trained on.
    """

    def __init__(self, n: int, batch_size: int, seed: int):
        """``n`` rows in batches of ``batch_size``, shuffled by a generator seeded with ``seed``."""
        self.n, self.batch_size = n, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch_start = self.generator.get_state()
        self.served = 0  # batches yielded in the epoch in progress
        self.resume_at = 0

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        self.epoch_start = self.generator.get_state()
        torch.empty((), dtype=torch.int64).random_(generator=self.generator)  # the DataLoader's worker base seed
        order = torch.randperm(self.n, generator=self.generator).tolist()
        torch.randperm(self.n, generator=self.generator)  # RandomSampler draws one more (empty) permutation
        start, self.resume_at = self.resume_at, 0
        for b in range(start, len(self)):
            self.served = b + 1
            yield order[b * self.batch_size : (b + 1) * self.batch_size]

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """The order's state after ``consumed`` batches of the epoch in progress were trained on."""
        consumed = self.served if consumed is None else consumed
        if consumed >= len(self):  # epoch finished: resume at the start of the next one
            return {"generator": self.generator.get_state(), "batches": 0}
        return {"generator": self.epoch_start, "batches": int(consumed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state: the next epoch (or the rest of one) as the saving run would have had it."""
        self.generator.set_state(state["generator"])
        self.resume_at = int(state["batches"])


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
