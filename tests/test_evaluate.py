"""The evaluate stage on the tiny model: predictions, metrics, resume, KVzap from an exported surrogate, tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from kvresearch.models import ModelAdapter
from kvresearch.runs import CONF_DIR, execute
from kvresearch.stages.evaluate import run
from kvresearch.surrogate import Surrogate, SurrogateConfig
from tests.conftest import compose_stage

SMALL = [
    "model=tiny_random",
    "benchmark.lengths=[1024]",
    "benchmark.samples_per_task=1",
    "benchmark.tasks=[niah_single_1,fwe]",
    "evaluate.max_samples=2",
]


def test_evaluate_full_cache_writes_predictions_and_resumes(tmp_path: Path) -> None:
    cfg = compose_stage("evaluate", tmp_path / "run", [*SMALL, f"out_root={tmp_path}"])
    metrics = execute(cfg, run)
    assert set(metrics["tasks"]) == {"niah_single_1@1024", "fwe@1024"}
    assert metrics["overall"]["prune_ratio"] == 0.0 and metrics["overall"]["agreement"] == 1.0
    lines = (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0])["id"] == "niah_single_1@1024#0"
    # A killed run: the last line is torn; the re-run keeps the first and redoes the second.
    (tmp_path / "run" / "predictions.jsonl").write_text(lines[0] + "\n" + lines[1][:20])
    (tmp_path / "run" / "DONE").unlink()
    again = execute(cfg, run)
    assert [json.loads(x)["id"] for x in (tmp_path / "run" / "predictions.jsonl").read_text().splitlines()] == [
        "niah_single_1@1024#0",
        "fwe@1024#0",
    ]
    assert again["overall"]["samples"] == 2


def test_evaluate_kvzap_from_an_exported_surrogate_and_make_tables(tmp_path: Path, tiny) -> None:
    adapter = ModelAdapter(tiny.model)
    torch.manual_seed(0)
    Surrogate(
        SurrogateConfig("mlp", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads, model="tiny_random")
    ).save(tmp_path / "surrogate")
    cfg = compose_stage(
        "evaluate",
        tmp_path / "evaluate" / "kvzap",
        [
            *SMALL,
            f"out_root={tmp_path}",
            "method=kvzap_mlp",
            f"method.surrogate_path={tmp_path / 'surrogate'}",
            "method.threshold=0.0",
            "method.window=16",
        ],
    )
    metrics = execute(cfg, run)
    assert metrics["method"] == "kvzap_mlp" and 0.0 < metrics["overall"]["prune_ratio"] < 1.0
    assert metrics["overall"]["full_answer_nll"] is not None and metrics["threshold"] == 0.0
    full = compose_stage("evaluate", tmp_path / "evaluate" / "full", [*SMALL, f"out_root={tmp_path}"])
    execute(full, run)
    result = subprocess.run(
        [sys.executable, "scripts/make_tables.py", "--root", str(tmp_path), "--out", str(tmp_path / "t")],
        cwd=CONF_DIR.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "t" / "ruler_table.md").read_text()
    assert "| full | - | 0.00 |" in text and "| kvzap_mlp | tau=0, window=16 |" in text  # options off the config shown
    assert (tmp_path / "t" / "ruler_curve.png").stat().st_size > 1000


def test_evaluate_attention_matching_reports_errors_and_step_times(tmp_path: Path) -> None:
    cfg = compose_stage(
        "evaluate",
        tmp_path / "run",
        [*SMALL, f"out_root={tmp_path}", "method=am_omp_fast", "method.keep_ratio=0.25", "method.max_queries=256"],
    )
    metrics = execute(cfg, run)
    assert metrics["method"] == "am_omp_fast" and abs(metrics["overall"]["prune_ratio"] - 0.75) < 0.02
    record = json.loads((tmp_path / "run" / "predictions.jsonl").read_text().splitlines()[0])
    report = record["method_report"]
    assert set(report["timings_s"]) == {"queries_s", "keys_s", "beta_s", "values_s"}
    assert 0.0 <= report["heldout_mass_rel"] < 1.0 and 0.0 <= report["heldout_output_rel_l2"] < 1.0
