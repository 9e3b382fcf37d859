"""Surrogates: planted-function learning through the real stage, ridge vs scikit-learn, metrics, export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.linear_model import Ridge
from sklearn.metrics import r2_score

from kvresearch.errors import KVResearchError
from kvresearch.ops.ridge import RidgeAccumulator
from kvresearch.runs import CONF_DIR, execute
from kvresearch.stages.train_surrogate import run
from kvresearch.surrogate import Surrogate, SurrogateConfig
from kvresearch.surrogate.data import ExtractRun
from kvresearch.surrogate.export import to_kvpress
from kvresearch.surrogate.metrics import fit_metrics
from kvresearch.surrogate.modules import from_run
from tests import helpers
from tests.helpers import compose_stage

LAYERS, D, HEADS = 3, 32, 2


def synthetic_extract(folder: Path, teacher: Callable[[torch.Tensor], torch.Tensor], **kwargs) -> dict:
    """An extract run of LAYERS x D hidden states whose targets are ``teacher(h)`` exactly."""
    return helpers.synthetic_extract(folder, teacher, LAYERS, D, HEADS, **kwargs)


def train(folder: Path, extract: Path, *overrides: str) -> dict:
    """The train_surrogate stage on the extract run ``extract``, in ``folder``."""
    return execute(compose_stage("train_surrogate", folder, [f"paths.extract={extract}", *overrides]), run)


def teacher(kind: str) -> Surrogate:
    torch.manual_seed(123)
    module = Surrogate(SurrogateConfig(kind, LAYERS, D, HEADS, mlp_hidden=D // 8))
    with torch.no_grad():
        for w in module.weights:
            w.mul_(3.0)
    return module.eval()


def planted(h: torch.Tensor) -> torch.Tensor:
    """A smooth function an MLP of width D/8 represents exactly: 2 GELU units per layer."""
    g = torch.Generator().manual_seed(1)
    u = torch.randn(LAYERS, D, 2, generator=g)
    u = 2 * u / u.norm(dim=1, keepdim=True)
    c = torch.randn(LAYERS, 2, HEADS, generator=g)
    return torch.einsum("nlk,lkh->nlh", torch.nn.functional.gelu(torch.einsum("nld,ldk->nlk", h, u)), c)


def test_mlp_learns_a_planted_function_through_the_stage(tmp_path: Path) -> None:
    synthetic_extract(tmp_path / "extract", planted, n_docs=24)
    # a noiseless target: the default's strong weight decay (1.0, against overfitting real scores) would shrink it
    overrides = ("surrogate=mlp", "surrogate.epochs=30", "surrogate.lr=1e-2", "surrogate.weight_decay=0.01")
    metrics = train(tmp_path / "train", tmp_path / "extract", *overrides)
    assert metrics["test"]["r2_mean"] > 0.99, metrics["test"]["r2_mean"]
    assert metrics["documents"] == {"train": 20, "val": 1, "test": 3}
    assert (tmp_path / "train" / "r2_per_layer.png").stat().st_size > 1000
    assert (tmp_path / "train" / "ckpt" / "last.ckpt").is_file()
    loaded = Surrogate.load(tmp_path / "train" / "export", expect_model="synthetic")
    assert loaded.config.kind == "mlp" and loaded.config.mlp_hidden == D // 8


def test_linear_ridge_through_the_stage_recovers_a_linear_map(tmp_path: Path) -> None:
    synthetic_extract(tmp_path / "extract", teacher("linear"), n_docs=16)
    metrics = train(tmp_path / "train", tmp_path / "extract", "surrogate=linear")
    assert metrics["fit"] == "ridge" and metrics["test"]["r2_mean"] > 0.999


def test_ridge_equals_scikit_learn() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(700, LAYERS, D, generator=g, dtype=torch.float64) * 2 + 1
    y = x[:, :, :HEADS] * 0.5 + torch.randn(700, LAYERS, HEADS, generator=g, dtype=torch.float64)
    acc = RidgeAccumulator(LAYERS, D, HEADS)
    for part in torch.split(torch.arange(700), 250):
        acc.update(x[part], y[part])
    weights, bias = acc.solve(alpha=1.0)
    for layer in range(LAYERS):
        ref = Ridge(alpha=1.0).fit(x[:, layer].numpy(), y[:, layer].numpy())
        np.testing.assert_allclose(weights[layer].T.numpy(), ref.coef_, rtol=1e-8, atol=1e-10)
        np.testing.assert_allclose(bias[layer].numpy(), ref.intercept_, rtol=1e-8, atol=1e-10)


def test_fit_metrics_equal_scikit_learn_and_hand_counts() -> None:
    rng = np.random.default_rng(0)
    truth = rng.normal(size=(300, 2, 3))
    pred = truth + rng.normal(scale=0.5, size=truth.shape)
    m = fit_metrics(truth, pred)
    assert m["r2_per_layer_head"][1][2] == pytest.approx(r2_score(truth[:, 1, 2], pred[:, 1, 2]))
    assert m["r2_mean"] == pytest.approx(
        np.mean([[r2_score(truth[:, i, j], pred[:, i, j]) for j in range(3)] for i in range(2)])
    )
    # Pruning view by hand: truth 1..9 keeps {7, 8, 9} at tau = 7; the prediction keeps {6, 9} above 7.
    t = np.arange(1.0, 10.0).reshape(9, 1, 1)
    p = np.array([1, 2, 3, 4, 5, 9, 6, 5, 8.0]).reshape(9, 1, 1)
    hand = fit_metrics(t, p)
    assert hand["oracle_threshold"] == pytest.approx(6.333333, rel=1e-5)
    assert (hand["precision"], hand["recall"]) == (pytest.approx(1 / 2), pytest.approx(1 / 3))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_kvpress_loads_our_export_and_scores_the_same(kind: str, tmp_path: Path) -> None:
    from kvpress.presses.kvzap_press import KVzapModel, KVzapPress

    ours = teacher(kind)
    to_kvpress(ours, tmp_path)
    theirs = KVzapModel.from_pretrained(tmp_path).eval()
    h = torch.randn(17, LAYERS, D)
    with torch.no_grad():
        torch.testing.assert_close(theirs(h), ours(h), rtol=1e-5, atol=1e-5)
        press = KVzapPress(model_type=kind)
        press.kvzap_model = theirs
        module = torch.nn.Module()
        module.layer_idx = 2
        scores = press.score(module, h[None, :, 2], None, None, None, {})  # (1, kv_heads, tokens)
        torch.testing.assert_close(scores[0].T, ours.forward_layer(2, h[:, 2]), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(KVResearchError, match=r"No finished extract run at .*make stage-extract"):
        ExtractRun(tmp_path / "missing")
    with pytest.raises(KVResearchError, match=rf"No extract run '{tmp_path / 'missing'}' under"):
        train(tmp_path / "t", tmp_path / "missing")
    synthetic_extract(tmp_path / "x", teacher("linear"), n_docs=2, rows=10)
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    manifest["layout"]["hidden"] = 576
    (tmp_path / "x" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(KVResearchError, match="shards from another model"):
        ExtractRun(tmp_path / "x")
    teacher("mlp").save(tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "surrogate.json").read_text())
    (tmp_path / "s" / "surrogate.json").write_text(json.dumps({**cfg, "model": "smollm2_135m"}))
    with pytest.raises(KVResearchError, match="trained for model 'smollm2_135m', not 'qwen3_8b'"):
        Surrogate.load(tmp_path / "s", expect_model="qwen3_8b")
    with pytest.raises(KVResearchError, match="No surrogate at"):
        Surrogate.load(tmp_path / "nothing")


def test_batched_forward_equals_per_layer_forward() -> None:
    module = teacher("mlp")
    h = torch.randn(9, LAYERS, D)
    out = module(h)
    for layer in range(LAYERS):
        torch.testing.assert_close(out[:, layer], module.forward_layer(layer, h[:, layer]))


@pytest.mark.slow
def test_hydra_multirun_over_surrogate_types(tmp_path: Path) -> None:
    synthetic_extract(tmp_path / "extract", planted, n_docs=10, rows=100)
    env = {**os.environ, "KVRESEARCH_OUTPUTS": str(tmp_path / "out")}
    cmd = [
        sys.executable,
        "-m",
        "kvresearch.stages.train_surrogate",
        "-m",
        "surrogate=linear,mlp",
        f"paths.extract={tmp_path / 'extract'}",
        "surrogate.epochs=2",
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=CONF_DIR.parent, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = sorted(p.name for p in (tmp_path / "out" / "train_surrogate").iterdir() if p.is_dir())
    assert len(runs) == 2 and all((tmp_path / "out" / "train_surrogate" / r / "DONE").is_file() for r in runs)


def test_a_deeper_mlp_is_the_stacked_per_layer_network_and_kvpress_refuses_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    deep = Surrogate(SurrogateConfig("mlp", LAYERS, D, HEADS, mlp_hidden=5, mlp_layers=3)).eval()
    shapes = [(LAYERS, D, 5), (LAYERS, 5, 5), (LAYERS, 5, 5), (LAYERS, 5, HEADS)]
    assert [tuple(w.shape) for w in deep.weights] == shapes
    h = torch.randn(7, LAYERS, D, dtype=torch.float64)
    for layer in range(LAYERS):  # nn.Linear by nn.Linear, in float64
        x = h[:, layer]
        for i, (w, b) in enumerate(zip(deep.weights, deep.biases, strict=True)):
            x = x @ w[layer].double() + b[layer].double()
            x = torch.nn.functional.gelu(x) if i < 3 else x
        torch.testing.assert_close(deep(h)[:, layer].double(), x, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(deep.forward_layer(layer, h[:, layer]).double(), x, rtol=1e-5, atol=1e-5)
    deep.save(tmp_path / "deep")
    again = Surrogate.load(tmp_path / "deep")
    assert again.config.mlp_layers == 3 and torch.equal(again(h), deep(h))
    with pytest.raises(KVResearchError, match=r"one hidden layer; this surrogate has 3 \(surrogate.mlp_layers\)"):
        to_kvpress(deep, tmp_path / "kvpress")
    teacher("mlp").save(tmp_path / "old")  # a surrogate.json written before mlp_layers existed loads as 1
    cfg = json.loads((tmp_path / "old" / "surrogate.json").read_text())
    del cfg["mlp_layers"]
    (tmp_path / "old" / "surrogate.json").write_text(json.dumps(cfg))
    assert Surrogate.load(tmp_path / "old").config.mlp_layers == 1
    with pytest.raises(KVResearchError, match="mlp_layers must be at least 1"):
        SurrogateConfig("mlp", LAYERS, D, HEADS, mlp_layers=0)


def test_the_stage_trains_a_deeper_mlp_and_skips_the_kvpress_export(tmp_path: Path) -> None:
    synthetic_extract(tmp_path / "extract", planted, n_docs=8, rows=40)
    overrides = ("surrogate=mlp", "surrogate.epochs=2", "+surrogate.mlp_layers=2")
    metrics = train(tmp_path / "train", tmp_path / "extract", *overrides)
    assert metrics["flops_per_token_per_layer"] == 2 * (D * (D // 8) + (D // 8) ** 2 + (D // 8) * HEADS)
    assert from_run(str(tmp_path / "train"), "mlp").config.mlp_layers == 2  # what a KVzap method loads
    assert not (tmp_path / "train" / "kvpress").exists()
