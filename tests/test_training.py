"""Surrogate training that survives a kill: resumable data order, checkpoints, force, damaged inputs named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from kvresearch.errors import KVResearchError
from kvresearch.runs import build, execute
from kvresearch.stages.train_surrogate import run
from kvresearch.surrogate import Surrogate
from kvresearch.surrogate.data import ExtractRun, ShuffledBatches
from kvresearch.surrogate.lightning import SurrogateModule
from tests.helpers import compose_stage, method_config, surrogate_run, synthetic_extract

LAYERS, D, HEADS = 2, 16, 2
RECIPE = ["surrogate=mlp", "surrogate.epochs=3", "surrogate.batch_size=64", "checkpoint_every_n_steps=4"]


def linear_teacher(h: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.einsum("nld,ldh->nlh", h, torch.randn(LAYERS, D, HEADS, generator=g))


@pytest.fixture(scope="module")
def extract(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("extract")
    synthetic_extract(folder, linear_teacher, LAYERS, D, HEADS, n_docs=12, rows=100, rows_per_shard=300)
    return folder  # 9 train documents: 900 rows, 15 batches of 64 per epoch


def train(folder: Path, extract: Path, *overrides: str) -> dict:
    return execute(compose_stage("train_surrogate", folder, [f"paths.extract={extract}", *RECIPE, *overrides]), run)


def weights(folder: Path) -> list[torch.Tensor]:
    return [p.detach().clone() for p in Surrogate.load(folder / "export").parameters()]


def kill_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Make training die (as a kill would, without a final save) when it reaches optimizer step ``step``."""
    original = SurrogateModule.training_step

    def killed(self, batch, index):
        if self.global_step == step:
            raise RuntimeError("killed")
        return original(self, batch, index)

    monkeypatch.setattr(SurrogateModule, "training_step", killed)


def test_the_resumable_order_is_the_dataloaders_and_continues_mid_epoch() -> None:
    n, batch = 1003, 64
    reference = DataLoader(list(range(n)), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(3))
    ours = ShuffledBatches(n, batch, seed=3)
    epochs = [[b.tolist() for b in reference] for _ in range(3)]
    assert [list(ours) for _ in range(3)] == epochs
    # Stop in the second epoch after 5 batches; a new order loaded from that state yields the rest, then epoch 3.
    order = ShuffledBatches(n, batch, seed=3)
    list(order)
    iterator = iter(order)
    taken = [next(iterator) for _ in range(6)]  # one more than trained on: a prefetched batch
    state = order.state_dict(consumed=5)
    resumed = ShuffledBatches(n, batch, seed=99)
    resumed.load_state_dict(state)
    assert taken[:5] + list(resumed) == epochs[1] and list(resumed) == epochs[2]


@pytest.mark.parametrize("step", [7, 8, 15])  # mid-epoch (last save at 4), on a save (8), after an epoch's save
def test_a_killed_then_resumed_run_ends_where_an_uninterrupted_run_ends(
    step: int, extract: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = train(tmp_path / "whole", extract)
    with monkeypatch.context() as patch:
        kill_at(patch, step)
        with pytest.raises(RuntimeError, match="killed"):
            train(tmp_path / "killed", extract)
    assert not (tmp_path / "killed" / "DONE").exists()
    resumed = train(tmp_path / "killed", extract)
    assert resumed["resumed_from_step"] == {7: 4, 8: 8, 15: 15}[step]
    for a, b in zip(weights(tmp_path / "whole"), weights(tmp_path / "killed"), strict=True):
        assert torch.equal(a, b)
    assert resumed["test"]["r2_mean"] == whole["test"]["r2_mean"] and resumed["val_mse"] == whole["val_mse"]


def test_force_trains_a_finished_run_again_from_the_start(extract: Path, tmp_path: Path) -> None:
    first = train(tmp_path / "run", extract)
    before = weights(tmp_path / "run")
    assert first["resumed_from_step"] is None
    assert train(tmp_path / "run", extract)["wall_s"] == first["wall_s"]  # DONE: skipped, its metrics returned
    forced = train(tmp_path / "run", extract, "force=true")
    assert forced["resumed_from_step"] is None  # trained from the start, not resumed from the final checkpoint
    assert all(torch.equal(a, b) for a, b in zip(before, weights(tmp_path / "run"), strict=True))


def test_a_truncated_checkpoint_is_named_with_what_to_do(
    extract: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patch:
        kill_at(patch, 6)
        with pytest.raises(RuntimeError):
            train(tmp_path / "run", extract)
    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    with pytest.raises(KVResearchError, match=rf"{ckpt} cannot be read .* Delete it to train this run from the start"):
        train(tmp_path / "run", extract)


def test_same_size_damage_and_non_finite_rows_in_a_shard_are_named(tmp_path: Path) -> None:
    synthetic_extract(tmp_path / "x", linear_teacher, LAYERS, D, HEADS, n_docs=4, rows=20)
    shard = tmp_path / "x" / "shards" / "shard-00000"
    scores = shard / "scores.npy"
    clean = scores.read_bytes()
    array = np.load(scores)
    array[3, 1, 0] = np.nan
    np.save(scores, array)
    assert scores.stat().st_size == len(clean)  # same size: only the checksum can tell
    with pytest.raises(KVResearchError, match=rf"{shard}: scores.npy fails its checksum"):
        ExtractRun(tmp_path / "x")
    meta = json.loads((shard / "shard.json").read_text())  # a shard written with the NaN in it
    meta["files"]["scores.npy"]["sha1"] = __import__("hashlib").sha1(scores.read_bytes()).hexdigest()
    (shard / "shard.json").write_text(json.dumps(meta))
    with pytest.raises(KVResearchError, match=r"scores.npy: 1 row\(s\) hold non-finite scores \(first: row 3\)"):
        ExtractRun(tmp_path / "x")


def test_a_half_written_manifest_and_a_corrupt_export_are_named(tmp_path: Path, tiny) -> None:
    synthetic_extract(tmp_path / "x", linear_teacher, LAYERS, D, HEADS, n_docs=2, rows=10)
    manifest = tmp_path / "x" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(KVResearchError, match=rf"{manifest} is not valid JSON .* Re-run extract"):
        ExtractRun(tmp_path / "x")
    from kvresearch.models import ModelAdapter

    adapter = ModelAdapter(tiny.model)
    surrogate_run(tmp_path / "s", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads)
    weights_file = tmp_path / "s" / "export" / "surrogate.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:200])
    with pytest.raises(KVResearchError, match=rf"{weights_file} cannot be read .* Re-train it"):
        build(method_config("kvzap_mlp", paths={"surrogate_mlp": str(tmp_path / "s")}))


def test_two_process_ddp_training_matches_one_process(extract: Path, tmp_path: Path) -> None:
    """CPU DDP (gloo, two forked processes, each half of every batch) ends at the one-process weights."""
    one = train(tmp_path / "one", extract)
    two = train(
        tmp_path / "two", extract, "+trainer.strategy=ddp_fork", "+trainer.devices=2", "trainer.accelerator=cpu"
    )
    for a, b in zip(weights(tmp_path / "one"), weights(tmp_path / "two"), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # the tolerance docs/cluster.md states
    assert two["test"]["r2_mean"] == pytest.approx(one["test"]["r2_mean"], abs=1e-4)
    assert (one["processes"], two["processes"]) == (1, 2)
