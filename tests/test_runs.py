"""Run folders, DONE markers, Hydra composition and the W&B offline mirror."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvresearch.runs import CONF_DIR, execute, run_name, write_atomic
from tests.conftest import compose_stage

REPO = CONF_DIR.parent


def test_execute_writes_artefacts_then_done_and_skips(tmp_path: Path) -> None:
    cfg = compose_stage("needle", tmp_path / "run")
    calls = []

    def stage(cfg, ctx):
        calls.append(ctx.out_dir)
        assert (ctx.out_dir / "config.yaml").is_file() and not (ctx.out_dir / "DONE").exists()
        return {"score": 1.0}

    metrics = execute(cfg, stage)
    out = tmp_path / "run"
    assert metrics["score"] == 1.0 and "wall_s" in metrics
    assert yaml.safe_load((out / "config.yaml").read_text())["stage"] == "needle"
    versions = yaml.safe_load((out / "versions.json").read_text())
    assert versions["packages"]["torch"] and "commit" in versions["git"]
    assert (out / "DONE").is_file()
    assert execute(cfg, stage)["score"] == 1.0 and len(calls) == 1  # skipped
    cfg.force = True
    execute(cfg, stage)
    assert len(calls) == 2


def test_failed_stage_leaves_no_done_and_no_metrics(tmp_path: Path) -> None:
    cfg = compose_stage("needle", tmp_path / "run")

    def broken(cfg, ctx):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        execute(cfg, broken)
    assert not (tmp_path / "run" / "DONE").exists()
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_write_atomic_leaves_no_temporary_file(tmp_path: Path) -> None:
    write_atomic(tmp_path / "a.json", "{}")
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_run_name_from_overrides() -> None:
    assert run_name("") == "default"
    assert run_name("model=qwen3_8b,method.threshold=-4") == "model=qwen3_8b,method.threshold=-4"
    assert "/" not in run_name("model.repo_id=/data/models/x")
    long_a = "benchmark.tasks=[" + ",".join(f"niah_task_{i}" for i in range(30)) + "],method.reduce=max"
    long_b = long_a.replace("max", "rms")
    name_a, name_b = run_name(long_a), run_name(long_b)
    assert len(name_a.encode()) <= 200 and name_a != name_b and name_a == run_name(long_a)  # short, distinct, stable
    assert name_a.startswith("benchmark.tasks=[niah_task_0,")


def test_wandb_offline_run_folder_holds_logged_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_stage("needle", tmp_path / "run", ["logger=wandb", "logger.project=kvr-test"])
    execute(cfg, lambda cfg, ctx: (ctx.tracker.log({"loss": 0.125}, step=0), {"accuracy_xyz": 0.75})[1])
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = next(runs[0].glob("run-*.wandb")).read_bytes()
    for token in (b"accuracy_xyz", b"0.75", b"loss", b"0.125", b"kvr-test"):
        assert token in records, token


def _stage_cli(args: list[str], env_extra: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "kvresearch.stages.needle", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_hydra_multirun_writes_one_folder_per_job_and_skips_on_rerun(tmp_path: Path) -> None:
    args = ["-m", "model=tiny_random", "needle.context_tokens=128,192", "needle.depths=[0.5]"]
    env = {"KVRESEARCH_OUTPUTS": str(tmp_path)}
    first = _stage_cli(args, env)
    assert first.returncode == 0, first.stderr
    folders = sorted(p.name for p in (tmp_path / "needle").iterdir() if p.is_dir())
    assert folders == [
        "model=tiny_random,needle.context_tokens=128,needle.depths=[0.5]",
        "model=tiny_random,needle.context_tokens=192,needle.depths=[0.5]",
    ]
    for name in folders:
        assert {"config.yaml", "versions.json", "metrics.json", "DONE"} <= {
            p.name for p in (tmp_path / "needle" / name).iterdir()
        }
    second = _stage_cli(args, env)
    assert second.returncode == 0 and second.stdout.count("skipping") == 2, second.stdout


def test_uncached_hub_model_fails_fast_with_one_paragraph(tmp_path: Path) -> None:
    import time

    start = time.perf_counter()
    result = _stage_cli(
        ["model=qwen3_8b"],
        {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "KVRESEARCH_OUTPUTS": str(tmp_path)},
        timeout=60,
    )
    elapsed = time.perf_counter() - start
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: The model 'Qwen/Qwen3-8B' is not in the local Hugging Face cache")
    assert "hf download Qwen/Qwen3-8B" in result.stderr
    assert elapsed < 10, elapsed
