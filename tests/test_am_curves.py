"""kvresearch/reports/am_curves.py on planted run folders: the claim check pairs answers, picks the best eviction."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvresearch.reports import am_curves


def plant(root: Path, name: str, keep: float | None, nll: list[float], prune: float, done: bool = True) -> None:
    """An evaluate run folder with one prediction per answer."""
    folder = root / "evaluate" / f"{name}-{keep}"
    folder.mkdir(parents=True)
    metrics = {"benchmark": {"name": "quality"}, "method": {"name": name, "keep_ratio": keep}}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    rows = [
        {"id": f"q{i}", "full_answer_nll": x, "prune_ratio": prune, "agrees_with_full": i % 2 == 0, "score": 1.0}
        for i, x in enumerate(nll)
    ]
    (folder / "predictions.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    if done:
        (folder / "DONE").touch()


def test_claim_check_pairs_answers_against_the_best_eviction_method(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    base = rng.uniform(0.1, 0.3, 20)
    plant(tmp_path, "full", None, list(base), 0.0)
    plant(tmp_path, "snapkv", 0.1, list(base + 0.2), 0.9)
    plant(tmp_path, "kvzip_plus", 0.1, list(base + 0.1), 0.9)  # the best eviction method at 0.1
    plant(tmp_path, "summarize", 0.1, list(base - 0.5), 0.9)  # not eviction: never the comparator
    plant(tmp_path, "am_omp", 0.1, list(base + 0.05 + rng.normal(0, 0.01, 20)), 0.89)
    plant(tmp_path, "am_highest", 0.1, list(base + 0.1 + rng.normal(0, 0.05, 20)), 0.89)
    plant(tmp_path, "am_omp", 0.02, [9.0] * 20, 0.98, done=False)  # unfinished: absent
    data = am_curves.runs(tmp_path, "quality")
    assert [r["keep"] for r in data["am_omp"]] == [0.1]
    assert data["am_omp"][0]["ratio"] == pytest.approx(1 / 0.11)
    rows = am_curves.claim_rows(data, 0.1)
    assert len(rows) == 2 and all("| kvzip_plus |" in r for r in rows)
    omp = next(r for r in rows if "| am_omp |" in r)
    am, evict = data["am_omp"][0]["nll_by_id"], data["kvzip_plus"][0]["nll_by_id"]
    direct = np.mean([am[k] - evict[k] for k in am])  # -0.05 by construction, up to the noise
    assert f"{direct:+.3f}" in omp and omp.endswith("| below |")
    assert am_curves.claim_rows(data, 0.05) == []  # no finished run at or below 0.05
