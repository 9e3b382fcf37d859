"""Run folders, DONE markers, Hydra composition and the W&B offline mirror."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvresearch.errors import KVResearchError
from kvresearch.runs import CONF_DIR, execute, resolve_run, run_id, run_name, write_atomic
from tests.helpers import compose_stage

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
    (out / "leftover.bin").write_text("from the first run")
    cfg.force = True
    execute(cfg, stage)
    assert len(calls) == 2 and not (out / "leftover.bin").exists()  # force starts over in an emptied folder


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


def test_wandb_tables_and_images_land_in_the_offline_run_with_its_group(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvresearch.tracking import tracker

    figure = tmp_path / "curve.png"
    plt.plot([0, 1], [1, 0])
    plt.savefig(figure)
    cfg = {"kind": "wandb", "mode": "offline", "project": "kvr-test", "group": "exp_group_xyz"}
    with tracker(cfg, {"experiment": "x"}, tmp_path, "table-run", "table") as t:
        t.table("summary", ["method", "score_col_xyz"], [["snapkv_row_xyz", 41.5], ["full", None]])
        t.image("figure", figure)
    run = next((tmp_path / "wandb").glob("offline-run-*"))
    records = next(run.glob("run-*.wandb")).read_bytes()
    for token in (b"exp_group_xyz", b"summary", b"figure"):
        assert token in records, token
    tables = [p.read_text() for p in run.rglob("*.table.json")]
    assert len(tables) == 1 and "snapkv_row_xyz" in tables[0] and "score_col_xyz" in tables[0]
    assert [p.suffix for p in run.rglob("media/images/*")] == [".png"]


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


def test_uncached_hub_model_fails_with_one_paragraph(tmp_path: Path) -> None:
    result = _stage_cli(
        ["model=qwen3_8b"],
        {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "KVRESEARCH_OUTPUTS": str(tmp_path)},
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: The model 'Qwen/Qwen3-8B' is not in the local Hugging Face cache")
    assert "hf download Qwen/Qwen3-8B" in result.stderr


def test_hub_check_makes_at_most_one_connection_attempt_and_none_offline(monkeypatch, tmp_path: Path) -> None:
    import socket

    from kvresearch.models import hub

    attempts: list[tuple] = []

    def refuse(address, timeout=None):
        attempts.append(address)
        raise OSError("unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(KVResearchError, match="HF_HUB_OFFLINE is set"):
        hub.ensure_available("Qwen/Qwen3-8B")
    assert attempts == []  # offline: no network at all
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(KVResearchError, match="cannot be reached"):
        hub.ensure_available("Qwen/Qwen3-8B")
    assert len(attempts) == 1  # one attempt, no retries


def test_runs_are_referenced_by_folder_or_id_and_must_be_finished(tmp_path: Path) -> None:
    done = tmp_path / "train_surrogate" / "surrogate.lr=0.001,surrogate=mlp"
    done.mkdir(parents=True)
    (done / "DONE").write_text("")
    unfinished = tmp_path / "train_surrogate" / "surrogate=linear"
    unfinished.mkdir()
    rid = run_id(done)
    assert len(rid) == 8 and rid == run_id(done)
    assert resolve_run(rid, "train_surrogate", tmp_path) == done.resolve()
    assert (
        resolve_run("train_surrogate/surrogate.lr=0.001,surrogate=mlp", "train_surrogate", tmp_path) == done.resolve()
    )
    assert resolve_run(str(done), "train_surrogate", tmp_path) == done.resolve()
    assert resolve_run("surrogate.lr=0.001,surrogate=mlp", "train_surrogate", tmp_path) == done.resolve()
    with pytest.raises(KVResearchError, match=r"not finished \(no DONE\)"):
        resolve_run("train_surrogate/surrogate=linear", "train_surrogate", tmp_path)
    listed = rf"runs there: train_surrogate/surrogate\.lr=0\.001,surrogate=mlp \(id {rid}\)\."  # as it can be passed
    with pytest.raises(KVResearchError, match=rf"No train_surrogate run 'ffffffff'.*{listed}"):
        resolve_run("ffffffff", "train_surrogate", tmp_path)


@pytest.mark.slow
def test_a_run_id_hands_a_folder_with_equals_and_commas_to_hydra_without_quoting(tmp_path: Path) -> None:
    """The folder name of a run holds `=` and `,`, which Hydra's parser refuses unquoted; its id does not."""
    extract = tmp_path / "extract" / "corpus.max_tokens=900,model=tiny_random"
    extract.mkdir(parents=True)
    (extract / "DONE").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "kvresearch.stages.train_surrogate", f"paths.extract={run_id(extract)}"],
        cwd=REPO,
        env={**os.environ, "KVRESEARCH_OUTPUTS": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{extract / 'manifest.json'} is missing" in result.stderr  # the id found the run; it has no manifest


@pytest.mark.slow
def test_a_sweep_goes_on_past_a_bad_run_and_reports_it_at_the_end(tmp_path: Path) -> None:
    args = ["-m", "model=tiny_random", "needle.depths=[0.5]", "needle.context_tokens=128,9000,192"]
    result = _stage_cli(args, {"KVRESEARCH_OUTPUTS": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    finished = sorted(p.parent.name for p in (tmp_path / "needle").glob("*/DONE"))
    assert finished == [
        "model=tiny_random,needle.context_tokens=128,needle.depths=[0.5]",
        "model=tiny_random,needle.context_tokens=192,needle.depths=[0.5]",
    ]
    report = result.stderr.split("run(s) of this sweep failed:")[1]
    assert "needle.context_tokens=9000" in report and "over model.max_context=4096" in report
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_bad_method_option_fails_in_one_paragraph_before_the_model_loads(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvresearch.stages.evaluate", "model=qwen3_8b", "method=snapkv", "method.keep_ratio=2"],
        cwd=REPO,
        env={**os.environ, "KVRESEARCH_OUTPUTS": str(tmp_path), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    # The hub model is absent: had it been loaded first, the error would be about the model.
    assert result.stderr.startswith("error: method snapkv: keep_ratio must lie in [0, 1]"), result.stderr


def test_config_changes_list_each_differing_setting_and_ignore_where_a_run_lives() -> None:
    from kvresearch.runs.changes import changes

    roots = {"outputs": "/old/out", "checkout": "/old/repo"}
    moved = {"outputs": "/new/out", "checkout": "/new/repo"}
    stored = {"seed": 0, "surrogate": {"weight_decay": 0.01, "epochs": 15}, "benchmark": {"tasks": ["a", "b"]},
              "force": False, "logger": {"kind": "none"}, "paths": {"root": "/old/out", "extract": "extract/default"},
              "out_dir": "/old/out/train_surrogate/x", "method": {"budgets": "/old/repo/conf/head_budgets/m.json"},
              "surrogate_run": "/old/out/train_surrogate/surrogate=mlp"}  # fmt: skip
    same = {**stored, "force": True, "logger": {"kind": "wandb", "group": "g"}, "paths": {**stored["paths"],
            "root": "/new/out"}, "out_dir": "/new/out/train_surrogate/x",
            "method": {"budgets": "/new/repo/conf/head_budgets/m.json"},
            "surrogate_run": "/new/out/train_surrogate/surrogate=mlp"}  # fmt: skip
    assert changes(stored, stored, roots, roots) == []
    assert changes(stored, same, roots, moved) == []  # moved outputs and checkout, forced, logged: the same run
    now = {**same, "surrogate": {"weight_decay": 1.0, "epochs": 15, "width": 72}, "benchmark": {"tasks": ["a"]},
           "method": {"budgets": "/elsewhere/m.json"},
           "paths": {**same["paths"], "extract_new": "extract/new"}}  # fmt: skip
    assert changes(stored, now, roots, moved) == [
        "benchmark.tasks: ['a', 'b'] -> ['a']",
        "method.budgets: <checkout>/conf/head_budgets/m.json -> /elsewhere/m.json",
        "surrogate.weight_decay: 0.01 -> 1.0",
        "surrogate.width: <absent> -> 72",  # a setting added since is a change too, but not a hand-off added since
    ]
    moved_extract = {**now, "paths": {**now["paths"], "extract": "extract/other"}}  # a hand-off that changed is
    assert "paths.extract: extract/default -> extract/other" in changes(stored, moved_extract, roots, moved)
    assert "paths.extract_new: extract/new -> <absent>" in changes(now, stored, moved, roots)  # removed


def test_a_run_folder_made_with_other_settings_is_refused_unless_forced_or_kept(tmp_path: Path) -> None:
    """A default changed in conf/ since a run gives the same folder name: the run must not pass for today's."""
    out = tmp_path / "run"
    calls = []

    def stage(cfg, ctx):
        calls.append(cfg.needle.context_tokens)
        return {"tokens": cfg.needle.context_tokens}

    execute(compose_stage("needle", out, ["model=tiny_random", "needle.context_tokens=128"]), stage)
    # The same folder, as a changed default would give it: the stored config says 128, today's 192.
    changed = compose_stage("needle", out, ["model=tiny_random", "needle.context_tokens=192"])
    with pytest.raises(KVResearchError, match=r"1 differ.*needle\.context_tokens: 128 -> 192.*force=true.*on_config"):
        execute(changed, stage)
    assert calls == [128] and (out / "DONE").is_file()  # nothing redone, nothing touched
    changed.on_config_change = "keep"
    assert execute(changed, stage)["tokens"] == 128 and calls == [128]  # kept as it is
    changed.on_config_change = "refuse"
    (out / "DONE").unlink()  # an unfinished run would resume under other settings: refused as well
    with pytest.raises(KVResearchError, match=r"needle\.context_tokens: 128 -> 192"):
        execute(changed, stage)
    changed.force = True
    assert execute(changed, stage)["tokens"] == 192 and calls == [128, 192]
    changed.force = False
    assert execute(changed, stage)["tokens"] == 192 and calls == [128, 192]  # the redone run is today's: skipped
    changed.on_config_change = "sometimes"
    with pytest.raises(KVResearchError, match="not one of refuse, keep"):
        execute(changed, stage)


def test_a_run_that_read_a_run_redone_since_is_refused(tmp_path: Path) -> None:
    """A surrogate retrained under the same name leaves the evaluate runs that read it with an unchanged config."""
    upstream = tmp_path / "train_surrogate" / "mlp"
    execute(compose_stage("needle", upstream, ["model=tiny_random"]), lambda cfg, ctx: {"r2": 0.7})
    calls = []

    def reader(cfg, ctx):
        calls.append(ctx.inputs.add(resolve_run("train_surrogate/mlp", "train_surrogate", cfg.paths.root)))
        return {"score": 1.0}

    cfg = compose_stage("needle", tmp_path / "needle" / "reader", ["model=tiny_random", f"paths.root={tmp_path}"])
    stamp = (upstream / "DONE").read_text().strip()
    assert execute(cfg, reader)["inputs"] == {"train_surrogate/mlp": stamp}
    execute(cfg, reader)
    assert len(calls) == 1  # nothing changed: skipped
    redo = compose_stage("needle", upstream, ["model=tiny_random", "force=true"])
    execute(redo, lambda cfg, ctx: {"r2": 0.8})
    with pytest.raises(KVResearchError, match=rf"input train_surrogate/mlp: finished {re.escape(stamp)} -> redone"):
        execute(cfg, reader)
    cfg.on_config_change = "keep"
    execute(cfg, reader)
    assert len(calls) == 1  # kept as it is
    cfg.on_config_change, cfg.force = "refuse", True
    assert execute(cfg, reader)["inputs"] == {"train_surrogate/mlp": (upstream / "DONE").read_text().strip()}
    cfg.force = False
    execute(cfg, reader)
    assert len(calls) == 2  # redone against today's surrogate, then skipped


def test_a_run_id_hydra_read_as_a_number_is_refused_with_the_fix() -> None:
    """Hydra reads an unquoted id such as 12e45678 as a float (here inf) and 01234567 as an int."""
    for number in (float("inf"), 1234567):
        with pytest.raises(KVResearchError, match="read as a number: quote the run id"):
            resolve_run(number, "train_surrogate")  # type: ignore[arg-type]


def test_an_unquoted_run_folder_on_the_command_line_is_refused_with_the_override_and_the_fix() -> None:
    from kvresearch.runs.runner import unparsable_override

    problem = unparsable_override(["model=tiny_random", "paths.extract=extract/corpus.n_train_per_source=75"])
    assert problem is not None and "'paths.extract=extract/corpus.n_train_per_source=75'" in problem
    assert """'paths.extract="extract/corpus.n_train_per_source=75"'""" in problem and "experiment step" in problem
    quoted = ['paths.extract="extract/corpus.n_train_per_source=75"', "paths.surrogate_mlp=surrogate_context:mlp"]
    assert unparsable_override([*quoted, "-m", "method=full,snapkv", "+x=[1,2]"]) is None
    assert "brackets" in (unparsable_override(["benchmark.tasks=[a"]) or "")
