"""scripts/surrogate_probe.py: each richer input explains exactly the part of a planted target it carries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from kvresearch.models import ModelAdapter
from kvresearch.ops.scores import value_output_norms
from kvresearch.runs import repo_root
from tests.helpers import model_config, synthetic_extract


def test_the_probe_credits_value_norms_neighbours_and_position_to_the_parts_they_carry(tmp_path: Path, tiny) -> None:
    adapter = ModelAdapter(tiny.model)
    layers, hidden, kv_heads = adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads
    torch.manual_seed(0)
    a = torch.randn(layers, hidden, kv_heads) / hidden**0.5

    def log_norms(h: torch.Tensor, layer: int) -> torch.Tensor:  # (rows, Hkv): each KV head's first query head
        _, _, v = adapter.project(layer, h[None])
        return value_output_norms(v[0], adapter.output_weight(layer))[:, 0].T.log()

    with torch.no_grad():  # each planted part gets a unit spread, so each input's share is plain to see
        scale = [1 / log_norms(torch.randn(2000, hidden), layer).std() for layer in range(layers)]

    def teacher(h: torch.Tensor) -> torch.Tensor:  # (rows, layers, D) of one document, positions 0..rows-1
        out = []
        position = torch.log1p(torch.arange(len(h), dtype=torch.float32))[:, None]
        for layer in range(layers):
            prev = torch.cat([h[:1, layer], h[:-1, layer]])  # h_{i-1} (the first row its own)
            out.append(log_norms(h[:, layer], layer) * scale[layer] + prev @ a[layer] + position / position.std())
        return torch.stack(out, 1)

    folder = tmp_path / "extract"
    manifest = synthetic_extract(folder, teacher, layers, hidden, kv_heads, n_docs=12, rows=300)
    for doc in manifest["documents"]:
        doc["source"] = "essays" if doc["index"] % 3 == 0 else "wiki"  # essays: the source left out
    (folder / "manifest.json").write_text(json.dumps(manifest))
    OmegaConf.save({"model": model_config("tiny_random")}, folder / "config.yaml")
    out = tmp_path / "probe.json"
    inputs = "h,value_norms,neighbours,position,value_norms+neighbours+position"
    cmd = [sys.executable, "scripts/surrogate_probe.py", "--extract", str(folder), "--inputs", inputs]
    done = subprocess.run([*cmd, "--out", str(out)], cwd=repo_root(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    mean = result["mean"]
    assert result["rows"] == {"train": 8 * 300, "test": 4 * 300}
    assert abs(result["both_neighbours_share"]["test"] - 298 / 300) < 1e-6  # every position but a document's ends
    assert mean["value_norms+neighbours+position"] > 0.99  # every planted part, all inputs together
    for part in ("value_norms", "neighbours", "position"):
        assert mean["h"] + 0.2 < mean[part] < mean["value_norms+neighbours+position"] - 0.2, part

    # --alphas solves each penalty from the same statistics: alpha 1 is the run above, a huge one the mean
    out = tmp_path / "alphas.json"
    cmd = [*cmd[:3], str(folder), "--inputs", "neighbours", "--alphas", "1,1e12", "--out", str(out)]
    done = subprocess.run(cmd, cwd=repo_root(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    by_alpha = json.loads(out.read_text())["mean"]
    assert abs(by_alpha["neighbours@alpha=1"] - mean["neighbours"]) < 1e-9
    assert abs(by_alpha["neighbours@alpha=1e+12"]) < 0.01  # every weight shrunk to about 0: the training mean
