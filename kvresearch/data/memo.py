"""Tensors computed once per key and kept on disk, so that runs of one outputs root share them.

The evaluate stage hands one to its session (``<outputs>/memo/<model>-<dtype>/``); a method whose
expensive part does not depend on its budget (KVzip+'s oracle scores) stores it under a key naming the
inputs, so the cells of a sweep over budgets compute it once. A file is written to a temporary name and
renamed; one that cannot be read is computed again.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


class TensorMemo:
    """Named tensors per key under ``folder`` (one safetensors file per key); see the module docstring."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.hits = 0
        self.misses = 0

    def path(self, key: str) -> Path:
        """The file of ``key``."""
        return self.folder / f"{hashlib.sha1(key.encode()).hexdigest()}.safetensors"

    def get_or_compute(self, key: str, compute: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The tensors stored under ``key``, else ``compute()``'s, stored for the next caller."""
        path = self.path(key)
        if path.is_file():
            try:
                found = load_file(str(path))
                self.hits += 1
                return found
            except (OSError, SafetensorError):
                pass  # damaged: computed and written again
        self.misses += 1
        out = compute()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        save_file({k: v.contiguous() for k, v in out.items()}, str(tmp), metadata={"key": key})
        os.replace(tmp, path)
        return out
