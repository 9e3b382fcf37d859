"""The per-head budget file: ``{"L{layer}H{kv_head}": share}``, shares summing to 1 (the reference code's format).

At keep ratio r over a span of n tokens with H compacted heads in total, head (l, h) keeps
``int(share * r * n * H)`` entries (``ops/budgets.sizes_from_shares``). The ``budgets`` stage writes the file
into its run folder; the ``am_*_budgets`` methods read it from that run (:func:`from_run`), named by
``paths.budgets`` (the step ``head_budgets:<model name>``), or from any file given as ``method.budgets.heads``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from kvresearch.errors import KVResearchError
from kvresearch.ops.budgets import HeadKey
from kvresearch.runs.resolve import resolve_run

FILE = "budgets.json"


@dataclass(frozen=True)
class BudgetFile:
    """A budget file and the budgets run that wrote it (None for a file given by hand)."""

    path: str
    run: str | None = None


def from_run(run: str, root: str | None = None) -> BudgetFile:
    """The budget file of a finished ``budgets`` run (a folder, an experiment step or a run id).

    Raises:
        KVResearchError: no such finished run; the message says how to make one.
    """
    try:
        folder = resolve_run(run, "budgets", root)
    except KVResearchError as error:
        raise KVResearchError(
            f"{error} The am_*_budgets methods read the per-head budgets a budgets run measured: make them with "
            "`make experiment-head_budgets` (one step per model), or give a file as method.budgets.heads=<path>."
        ) from error
    return BudgetFile(str(folder / FILE), str(folder))


_KEY = re.compile(r"^L(\d+)H(\d+)$")


def head_name(layer: int, head: int) -> str:
    """The file's key of (layer, kv_head)."""
    return f"L{layer}H{head}"


def parse_shares(raw: dict[str, float], source: str = "budgets") -> dict[HeadKey, float]:
    """{(layer, head): share} from the file's mapping; shares must be >= 0 and sum to 1 (within 1e-3)."""
    shares: dict[HeadKey, float] = {}
    for key, value in raw.items():
        match = _KEY.match(key)
        if match is None:
            raise KVResearchError(f"{source}: key {key!r} is not of the form L<layer>H<kv_head> (e.g. L3H1).")
        if not value >= 0:
            raise KVResearchError(f"{source}: share of {key} must be >= 0, got {value}.")
        shares[(int(match[1]), int(match[2]))] = float(value)
    total = sum(shares.values())
    if abs(total - 1) > 1e-3:
        raise KVResearchError(f"{source}: shares must sum to 1, they sum to {total:.6f}; normalise the file.")
    return shares


def load_shares(path: str | Path) -> dict[HeadKey, float]:
    """Read a budget file (see the module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise KVResearchError(
            f"budget file {p} does not exist; write one with `make experiment-head_budgets` or pass "
            "method.budgets.heads=uniform."
        )
    return parse_shares(json.loads(p.read_text()), str(p))


def dump_shares(shares: dict[HeadKey, float]) -> dict[str, float]:
    """The file's mapping, in (layer, head) order."""
    return {head_name(layer, head): shares[(layer, head)] for layer, head in sorted(shares)}
