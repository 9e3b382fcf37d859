"""Work split across jobs: contiguous blocks of a stage's items, one run folder per part, then a merge.

A stage that shards (``extract``, ``evaluate``) takes ``<stage>.num_shards`` = n and ``<stage>.shard_index``
= k: job k works on the k-th of n contiguous blocks of its items (:func:`part_range`) in its own run folder,
named by its overrides like any run. The same command without ``shard_index`` merges: it finds the parts
as the runs named by its own overrides plus ``<stage>.shard_index=k`` (:func:`part_runs`), or takes the
list ``<stage>.parts``, and refuses to merge while one is unfinished.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvresearch.errors import KVResearchError
from kvresearch.runs import is_done, resolve_run, run_with
from kvresearch.runs.provenance import Inputs


def part_range(n_items: int, num_shards: int, shard_index: int, stage: str) -> range:
    """Item indices of job ``shard_index`` of ``num_shards``: contiguous blocks whose sizes differ by at most one."""
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise KVResearchError(
            f"{stage}.shard_index={shard_index} with {stage}.num_shards={num_shards}: the index must be in "
            f"0..{num_shards - 1} (and num_shards >= 1)."
        )
    base, extra = divmod(n_items, num_shards)
    start = shard_index * base + min(shard_index, extra)
    return range(start, start + base + (shard_index < extra))


def merging(num_shards: int, shard_index: int | None) -> bool:
    """Whether a job with these settings merges finished parts (several shards, no index of its own)."""
    return int(num_shards) > 1 and shard_index is None


def part_runs(out_dir: Path, stage: str, num_shards: int, explicit: Sequence[str] | None, inputs: Inputs) -> list[Path]:
    """The finished part runs to merge, in order, each noted in ``inputs``.

    ``explicit`` (references) if given, else the parts named from this job's overrides.
    """
    if explicit:
        return [inputs.add(resolve_run(str(p), stage, inputs.root)) for p in explicit]
    folders = [run_with(out_dir, f"{stage}.shard_index={k}") for k in range(num_shards)]
    missing = [str(f) for f in folders if not is_done(f)]
    if missing:
        raise KVResearchError(
            f"Cannot merge: {len(missing)} of {num_shards} {stage} parts are not finished ({'; '.join(missing[:4])}). "
            f"Run them first: the same command with `-m {stage}.shard_index={','.join(map(str, range(num_shards)))}` "
            f"(a finished part is skipped), or list finished runs in {stage}.parts."
        )
    return [inputs.add(f) for f in folders]
