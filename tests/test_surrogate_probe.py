"""scripts/surrogate_probe.py: each richer input explains exactly the part of a planted target it carries."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from kvresearch.models import ModelAdapter
from kvresearch.ops.scores import value_output_norms
from kvresearch.runs import repo_root
from tests.helpers import model_config, synthetic_extract


def log_norms(adapter: ModelAdapter, h: torch.Tensor, layer: int) -> torch.Tensor:
    """(rows, Hkv, G): the exact log ||v_i W_O^g|| of every query head."""
    _, _, v = adapter.project(layer, h[None])
    return value_output_norms(v[0], adapter.output_weight(layer)).permute(2, 0, 1).log()


def probe(tmp_path: Path, teacher: Callable[[torch.Tensor], torch.Tensor], adapter: ModelAdapter, *args: str) -> Any:
    """Run the probe (``args``) on a 12-document extract of ``teacher``'s targets, essays left out; its JSON."""
    folder = tmp_path / "extract"
    if not folder.exists():
        layers, hidden, kv_heads = adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads
        manifest = synthetic_extract(folder, teacher, layers, hidden, kv_heads, n_docs=12, rows=300)
        for doc in manifest["documents"]:
            doc["source"] = "essays" if doc["index"] % 3 == 0 else "wiki"  # essays: the source left out
        (folder / "manifest.json").write_text(json.dumps(manifest))
        OmegaConf.save({"model": model_config("tiny_random")}, folder / "config.yaml")
    out = tmp_path / f"probe{len(list(tmp_path.glob('probe*.json')))}.json"
    cmd = [sys.executable, "scripts/surrogate_probe.py", "--extract", str(folder), *args, "--out", str(out)]
    done = subprocess.run(cmd, cwd=repo_root(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def test_the_probe_credits_value_norms_neighbours_and_position_to_the_parts_they_carry(tmp_path: Path, tiny) -> None:
    adapter = ModelAdapter(tiny.model)
    layers, hidden, kv_heads = adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads
    torch.manual_seed(0)
    a = torch.randn(layers, hidden, kv_heads) / hidden**0.5
    with torch.no_grad():  # each planted part gets a unit spread, so each input's share is plain to see
        scale = [1 / log_norms(adapter, torch.randn(2000, hidden), layer)[..., 0].std() for layer in range(layers)]

    def teacher(h: torch.Tensor) -> torch.Tensor:  # (rows, layers, D) of one document, positions 0..rows-1
        out = []
        position = torch.log1p(torch.arange(len(h), dtype=torch.float32))[:, None]
        for layer in range(layers):
            prev = torch.cat([h[:1, layer], h[:-1, layer]])  # h_{i-1} (the first row its own)
            norms = log_norms(adapter, h[:, layer], layer)[..., 0]  # each KV head's first query head
            out.append(norms * scale[layer] + prev @ a[layer] + position / position.std())
        return torch.stack(out, 1)

    inputs = "h,value_norms,neighbours,position,value_norms+neighbours+position"
    result = probe(tmp_path, teacher, adapter, "--inputs", inputs)
    mean = result["mean"]
    assert result["rows"] == {"train": 8 * 300, "test": 4 * 300}
    assert abs(result["both_neighbours_share"]["test"] - 298 / 300) < 1e-6  # every position but a document's ends
    assert mean["value_norms+neighbours+position"] > 0.99  # every planted part, all inputs together
    for part in ("value_norms", "neighbours", "position"):
        assert mean["h"] + 0.2 < mean[part] < mean["value_norms+neighbours+position"] - 0.2, part

    # --alphas solves each penalty from the same statistics: alpha 1 is the run above, a huge one the mean
    by_alpha = probe(tmp_path, teacher, adapter, "--inputs", "neighbours", "--alphas", "1,1e12")["mean"]
    assert abs(by_alpha["neighbours@alpha=1"] - mean["neighbours"]) < 1e-9
    assert abs(by_alpha["neighbours@alpha=1e+12"]) < 0.01  # every weight shrunk to about 0: the training mean


def test_the_factored_mlp_fits_a_target_of_the_kvzip_plus_form_that_a_plain_mlp_cannot(tmp_path: Path, tiny) -> None:
    adapter = ModelAdapter(tiny.model)
    offsets = torch.tensor([[0.0, -1.0], [0.5, -0.5]])  # (Hkv, G): each query head's attention term, constant

    def teacher(h: torch.Tensor) -> torch.Tensor:  # log max over g of a_g ||v W_O^g||, smoothed as logsumexp
        layers = range(adapter.num_layers)
        return torch.stack([(log_norms(adapter, h[:, i], i) + offsets).logsumexp(-1) for i in layers], 1)

    recipe = ["--set", "epochs=40", "batch_size=64", "lr=1e-2", "weight_decay=0"]
    result = probe(tmp_path, teacher, adapter, "--fit", "mlp", "--inputs", "h,value_norms,factored", *recipe)
    mean = result["mean"]
    assert result["fit"] == "mlp" and result["recipe"]["epochs"] == 40 and result["recipe"]["lr"] == 5e-3 * 2
    assert len(result["r2_pooled_per_layer"]["factored"]) == adapter.num_layers
    assert mean["factored"] > 0.99, mean  # the form is exact: only the offsets are left to learn
    assert mean["h"] < mean["value_norms"] - 0.2, mean  # width D/8 = 8 cannot form a 64-wide quadratic's log
    assert mean["h"] < mean["factored"] - 0.3, mean

    bad = [sys.executable, "scripts/surrogate_probe.py", "--inputs", "factored"]  # ridge: refused before loading
    done = subprocess.run(bad, cwd=repo_root(), capture_output=True, text=True)
    assert done.returncode != 0 and "--fit mlp" in done.stderr
    typo = [*bad[:2], "--extract", str(tmp_path / "extract"), "--fit", "mlp", "--set", "weightdecay=0"]
    done = subprocess.run(typo, cwd=repo_root(), capture_output=True, text=True)
    assert done.returncode != 0 and "weightdecay" in done.stderr and "weight_decay" in done.stderr
