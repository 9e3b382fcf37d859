"""The prepared device check at the tiny CPU shape: it runs every step and writes its JSON and summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvresearch.device_check import interpreter_refuses

pytestmark = pytest.mark.compat  # also run on the GPU image's versions (make compat)


@pytest.mark.slow
def test_the_device_check_runs_every_step_at_the_tiny_shape(tmp_path: Path) -> None:
    """The Triton kernel runs in its interpreter here; on a GPU the same command measures the Qwen3-8B shape."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [
        sys.executable,
        "-m",
        "kvresearch.device_check",
        "--out",
        str(tmp_path),
        "--plan",
        "tiny",
        "--contexts",
        "160",
        "224",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert set(report["steps"]) == {"decode", "kvzap", "memory", "extraction", "am", "eval"}
    decode = report["steps"]["decode"]
    refused = interpreter_refuses()  # Triton 3.6 (make compat) with NumPy >= 2.4
    assert report["cut"] == ({"decode.triton": f"no CUDA device, and {refused}"} if refused else {})
    assert len(decode) == 6 and all(refused or row["max_abs_logit_diff"] < 1e-4 for row in decode)  # Triton == torch
    by_keep = {row["kept"]: row["kv_bytes_kept"] for row in decode if row["context"] == 224}
    assert by_keep[0.1] < by_keep[0.3333] < by_keep[1.0]  # real eviction: fewer bytes held
    assert all(0.3 < row["prune_ratio"] < 0.9 for row in report["steps"]["kvzap"])  # a threshold set for ~3x
    memory = report["steps"]["memory"]
    assert memory["kvzap_kv_bytes"] < memory["full_kv_bytes"]
    if "kvpress_refused" not in memory:  # kvpress 0.5.5 on transformers 5.17 (make compat) reads a gone argument
        assert memory["full_kv_bytes"] <= memory["kvpress_kv_bytes"] * 1.1  # kvpress masks: it keeps everything
    assert report["steps"]["extraction"]["rows_per_s"] > 0
    assert [row["method"] for row in report["steps"]["am"]] == ["am_highest", "am_omp"]
    for row in report["steps"]["eval"]:  # the stage and kvpress's pipeline, taking turns on one RULER sample
        assert "kvpress_refused" in row or (row["identical_predictions"] == 1 and row["ours"]["wall_s"] > 0), row
    assert [row["method"] for row in report["steps"]["eval"]] == ["full", "snapkv", "kvzap_mlp"]
    assert report["versions"]["torch"] and report["settings"]["model_config"]["num_key_value_heads"] == 8
    summary = (tmp_path / "device_check.md").read_text()
    assert summary.startswith("# Device check: CPU") and "## decode" in summary and "## am" in summary
