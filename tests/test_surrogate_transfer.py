"""kvresearch/studies/transfer.py: per-source held-out fit of a finished surrogate, against a direct computation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from kvresearch.runs import repo_root
from tests.helpers import surrogate_run, synthetic_extract


def test_transfer_scores_each_source_and_all_of_them(tmp_path: Path) -> None:
    layers, hidden, kv_heads = 3, 16, 2
    planted = surrogate_run(tmp_path / "planted", layers, hidden, kv_heads, kind="linear", model="synthetic")
    noise: list[torch.Tensor] = []
    clean: list[torch.Tensor] = []

    def teacher(h: torch.Tensor) -> torch.Tensor:  # even documents: the planted map; odd ones: plus noise
        with torch.no_grad():
            y = planted(h)
        clean.append(y)
        noise.append(torch.randn_like(y) * y.std() * (len(clean) % 2 == 0))
        return y + noise[-1]

    folder = tmp_path / "extract"
    manifest = synthetic_extract(folder, teacher, layers, hidden, kv_heads, n_docs=6, rows=200)
    for doc in manifest["documents"]:
        doc["source"], doc["split"] = ("news" if doc["index"] % 2 == 0 else "fiction"), "test"
    manifest["model"] = "synthetic"
    (folder / "manifest.json").write_text(json.dumps(manifest))

    json_out = tmp_path / "outputs"
    cmd = [sys.executable, "-m", "kvresearch.studies.transfer", "--extract", str(folder), "--surrogate",
           f"planted={tmp_path / 'planted'}", "--out", str(tmp_path), "--name", "transfer"]  # fmt: skip
    env = {**os.environ, "KVRESEARCH_OUTPUTS": str(json_out)}
    done = subprocess.run(cmd, cwd=repo_root(), capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((json_out / "transfer.json").read_text())["results"]["planted"]

    assert results["news"]["r2_pooled_per_layer"] > 1 - 1e-5 and results["news"]["rows"] == 600
    truth = torch.cat([c + n for c, n in zip(clean[1::2], noise[1::2], strict=True)]).double().numpy()
    pred = torch.cat(clean[1::2]).double().numpy()
    direct = np.mean([1 - ((truth[:, i] - pred[:, i]) ** 2).sum() / ((truth[:, i] - truth[:, i].mean()) ** 2).sum()
                      for i in range(layers)])  # fmt: skip
    assert 0.2 < direct < 0.8
    assert abs(results["fiction"]["r2_pooled_per_layer"] - direct) < 1e-4
    assert results["all"]["rows"] == 1200
    assert results["fiction"]["r2_pooled_per_layer"] < results["all"]["r2_pooled_per_layer"] < 1
    table = (tmp_path / "transfer.md").read_text()
    assert "| fiction (600) |" in table and "| news (600) | 1.000 /" in table and "| all (1,200) |" in table


def test_transfer_names_a_malformed_column() -> None:
    cmd = [sys.executable, "-m", "kvresearch.studies.transfer", "--surrogate", "mlp"]
    done = subprocess.run(cmd, cwd=repo_root(), capture_output=True, text=True)
    assert done.returncode != 0 and "expected NAME=RUN" in done.stderr


def test_transfer_refuses_a_surrogate_trained_on_a_tested_source(tmp_path: Path) -> None:
    layers, hidden, kv_heads = 2, 8, 1
    planted = surrogate_run(tmp_path / "planted", layers, hidden, kv_heads, kind="linear", model="synthetic")
    folder = tmp_path / "extract"
    manifest = synthetic_extract(folder, lambda h: planted(h).detach(), layers, hidden, kv_heads, n_docs=2, rows=20)
    manifest["model"] = "synthetic"
    for doc in manifest["documents"]:
        doc["source"] = "news"
    (folder / "manifest.json").write_text(json.dumps(manifest))  # its train document is news, its test one too
    recorded = json.loads((tmp_path / "planted" / "metrics.json").read_text())
    (tmp_path / "planted" / "metrics.json").write_text(json.dumps({**recorded, "extract_run": str(folder)}))
    cmd = [sys.executable, "-m", "kvresearch.studies.transfer", "--extract", str(folder), "--surrogate",
           f"planted={tmp_path / 'planted'}", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, cwd=repo_root(), capture_output=True, text=True)
    assert done.returncode != 0 and "trained on news, which this extract tests on" in done.stderr
