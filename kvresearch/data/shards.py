"""Sharded, streamed storage of (hidden state, log score) pairs, read back memory-mapped.

Layout of an extract run folder::

    shards/shard-00000/hidden.npy   (rows, layers, hidden)  bf16 bits as uint16, or float16
                                    (a shard is named by its first document index)
                       scores.npy   (rows, layers, kv_heads) float32, log KVzip+
                       doc.npy      (rows,) int32, document index into manifest["documents"]
                       pos.npy      (rows,) int32, token offset inside the document's context
                       shard.json   rows, document indices, file sizes and sha1 (written last)
    manifest.json                   layout, corpus statistics, documents, shards (written at the end)

A shard holds whole, consecutive documents only and is named by the first of them, so a run that redoes
the documents of a lost shard writes the same shard again, and jobs that extract disjoint documents never
collide. It is written under a temporary name and renamed into place, so a ``shard-*`` folder is complete
unless its files were damaged later, which :func:`check_shard` detects (missing file, size mismatch, and
with ``full=True`` a checksum mismatch); :func:`check_finite` rejects non-finite rows. Plain ``.npy``
files were chosen over Arrow because ``numpy.load(mmap_mode="r")`` gives zero-copy row access for training.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvresearch.errors import KVResearchError

HIDDEN_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FILES = ("hidden.npy", "scores.npy", "doc.npy", "pos.npy")


def _sha1(path: Path) -> str:
    digest = hashlib.sha1()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def hidden_to_numpy(hidden: torch.Tensor, dtype: str) -> np.ndarray:
    """bf16 is stored as its raw 16 bits (numpy has no bfloat16)."""
    t = hidden.to(HIDDEN_DTYPES[dtype]).contiguous()
    return t.view(torch.uint16).numpy() if dtype == "bfloat16" else t.numpy()


def hidden_from_numpy(array: np.ndarray, dtype: str) -> torch.Tensor:
    """Stored hidden states back as a tensor (bf16 from its 16 bits)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


@dataclass
class ShardWriter:
    """Buffers whole documents and writes a shard once ``rows_per_shard`` rows are buffered."""

    root: Path
    hidden_dtype: str
    rows_per_shard: int
    _parts: list[dict[str, np.ndarray]] = field(default_factory=list)
    _docs: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise KVResearchError(f"extract.hidden_dtype must be one of {sorted(HIDDEN_DTYPES)}")
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def buffered_rows(self) -> int:
        """Rows waiting for the next flush."""
        return sum(len(p["doc"]) for p in self._parts)

    def add(self, doc_index: int, positions: torch.Tensor, hidden: torch.Tensor, scores: torch.Tensor) -> None:
        """One document: positions (n,), hidden (n, layers, hidden), scores (n, layers, kv_heads)."""
        n = positions.numel()
        if hidden.shape[0] != n or scores.shape[0] != n:
            raise ValueError(f"rows differ: positions {n}, hidden {tuple(hidden.shape)}, scores {tuple(scores.shape)}")
        self._parts.append(
            {
                "hidden.npy": hidden_to_numpy(hidden, self.hidden_dtype),
                "scores.npy": scores.float().numpy(),
                "doc": np.full(n, doc_index, dtype=np.int32),
                "pos": positions.to(torch.int32).numpy(),
            }
        )
        self._docs.append(doc_index)
        if self.buffered_rows >= self.rows_per_shard:
            self.flush()

    def flush(self) -> Path | None:
        """Write the buffered documents as one shard (temporary folder, files, shard.json, rename)."""
        if not self._parts:
            return None
        name = f"shard-{self._docs[0]:05d}"
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        arrays = {
            "hidden.npy": np.concatenate([p["hidden.npy"] for p in self._parts]),
            "scores.npy": np.concatenate([p["scores.npy"] for p in self._parts]),
            "doc.npy": np.concatenate([p["doc"] for p in self._parts]),
            "pos.npy": np.concatenate([p["pos"] for p in self._parts]),
        }
        files = {}
        for fname, array in arrays.items():
            np.save(tmp / fname, array)
            files[fname] = {
                "shape": list(array.shape),
                "dtype": str(array.dtype),
                "bytes": (tmp / fname).stat().st_size,
                "sha1": _sha1(tmp / fname),
            }
        meta = {"name": name, "rows": len(arrays["doc.npy"]), "documents": self._docs, "files": files}
        (tmp / "shard.json").write_text(json.dumps(meta, indent=1))
        final = self.root / name
        if final.exists():  # a damaged copy of the same documents, removed by the caller's check
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._parts, self._docs = [], []
        return final


def check_shard(path: Path, full: bool = False) -> dict[str, Any]:
    """Validate a finished shard and return its shard.json; raise KVResearchError naming the damage."""
    meta_path = path / "shard.json"
    advice = "Re-run extract (no force needed): it removes the damaged shard and redoes only its documents."
    if not meta_path.is_file():
        raise KVResearchError(f"Shard {path} has no shard.json (unfinished or damaged). {advice}")
    try:
        meta = json.loads(meta_path.read_text())
        specs = meta["files"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise KVResearchError(f"Shard {path}: shard.json is damaged ({error}). {advice}") from error
    for fname in FILES:
        spec, file = specs.get(fname), path / fname
        if spec is None or not file.is_file():
            raise KVResearchError(f"Shard {path}: {fname} is missing. {advice}")
        if file.stat().st_size != spec["bytes"]:
            raise KVResearchError(
                f"Shard {path}: {fname} has {file.stat().st_size} bytes, expected {spec['bytes']}: it was cut short. "
                f"{advice}"
            )
        if full and _sha1(file) != spec["sha1"]:
            raise KVResearchError(f"Shard {path}: {fname} fails its checksum (damaged on disk). {advice}")
    return {**meta, "name": path.name}


def finished_shards(root: Path, full: bool = False, repair: bool = False) -> list[dict[str, Any]]:
    """shard.json of every finished shard under ``root``, validated; leftover temporary folders are removed.

    ``repair``: a damaged shard is removed (with a message naming the damage) instead of raising, so that
    the caller redoes its documents.
    """
    if not root.is_dir():
        return []
    for tmp in root.glob(".tmp-shard-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    metas = []
    for path in sorted(root.glob("shard-*")):
        try:
            metas.append(check_shard(path, full))
        except KVResearchError as error:
            if not repair:
                raise
            problem = str(error).split(" Re-run")[0].split(" Delete")[0].rstrip(". ")
            print(f"[extract] removing a damaged shard, its documents are redone: {problem}", flush=True)
            shutil.rmtree(path)
    return metas


def check_finite(shard: Shard, path: Path) -> None:
    """Raise naming the file if any stored score or hidden state is NaN or infinite."""
    advice = "Delete that shard folder and re-run extract (it redoes only its documents)."
    bad = np.flatnonzero(~np.isfinite(shard.scores).reshape(len(shard.scores), -1).all(axis=1))
    if len(bad):
        raise KVResearchError(
            f"{path / 'scores.npy'}: {len(bad)} row(s) hold non-finite scores (first: row {bad[0]}). {advice}"
        )
    bits = np.asarray(shard.hidden).reshape(len(shard.hidden), -1)
    nonfinite = (bits & 0x7F80) == 0x7F80 if bits.dtype == np.uint16 else ~np.isfinite(bits)  # bf16: exponent all ones
    bad = np.flatnonzero(nonfinite.any(axis=1))
    if len(bad):
        raise KVResearchError(
            f"{path / 'hidden.npy'}: {len(bad)} row(s) hold non-finite values (first: row {bad[0]}). {advice}"
        )


@dataclass
class Shard:
    """One shard, memory-mapped: nothing is read until rows are indexed."""

    hidden: np.ndarray  # (rows, layers, hidden) uint16 (bf16 bits) or float16
    scores: np.ndarray  # (rows, layers, kv_heads) float32
    doc: np.ndarray  # (rows,) int32
    pos: np.ndarray  # (rows,) int32


def open_shard(path: Path, full: bool = False) -> Shard:
    """A checked shard, memory-mapped (``full``: verify checksums and reject non-finite rows too)."""
    check_shard(path, full)
    load = lambda name: np.load(path / name, mmap_mode="r")
    shard = Shard(load("hidden.npy"), load("scores.npy"), load("doc.npy"), load("pos.npy"))
    if full:
        check_finite(shard, path)
    return shard
