"""Work split across jobs: a sharded extract merges to the single job's rows, a sharded evaluation to its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvresearch.errors import KVResearchError
from kvresearch.runs import CONF_DIR, execute, run_id
from kvresearch.sharding import part_range
from kvresearch.stages.evaluate import run as evaluate_run
from kvresearch.stages.extract import run as extract_run
from kvresearch.stages.extract import verify
from kvresearch.surrogate.data import ExtractRun
from tests.helpers import SMALL_RULER, compose_stage

TINY = [  # 4 short documents, 40 rows each
    "model=tiny_random",
    "corpus.min_tokens=60",
    "corpus.max_tokens=120",
    "corpus.n_train_per_source=1",
    "corpus.n_test_per_source=1",
    "extract.samples_per_doc=40",
    "extract.max_docs=4",
]
SMALL = SMALL_RULER
CHANGED = {"evaluate.max_samples": "4", "benchmark.samples_per_task": "2"}  # 4 samples, 2 per part
SMALL_EVAL = [x for x in SMALL if x.split("=")[0] not in CHANGED] + [f"{k}={v}" for k, v in CHANGED.items()]


def evaluate(root: Path, *overrides: str, base: tuple[str, ...]) -> dict:
    """One evaluate run under ``root``, its folder named from the overrides as Hydra names it."""
    return execute(compose_stage("evaluate", None, [*base, f"paths.root={root}", *overrides]), evaluate_run)


def lines(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "predictions.jsonl").read_text().splitlines()]


def single_full(root: Path) -> str:
    """The unsplit full-cache run that every part takes its reference answers from."""
    metrics = evaluate(root, "method=full", base=tuple(SMALL_EVAL))
    return str(root / "evaluate" / metrics["run"]["name"])


EXTRACT = [*TINY, "extract.rows_per_shard=100"]  # 40 rows per document: a single job's shards span 3 documents


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def test_part_ranges_cover_the_documents_once_in_order() -> None:
    for n_docs in (0, 1, 5, 7, 12):
        for n in (1, 2, 3, 5):
            parts = [part_range(n_docs, n, k, "extract") for k in range(n)]
            assert [i for p in parts for i in p] == list(range(n_docs))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    with pytest.raises(KVResearchError, match=r"shard_index=2 with extract.num_shards=2"):
        part_range(4, 2, 2, "extract")


def all_rows(folder: Path) -> tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor]:
    data = ExtractRun(folder)
    rows = np.arange(len(data.doc))
    positions = np.concatenate([np.asarray(s.pos) for s in data.shards])
    return data.doc, positions, *data.fetch(rows)


def test_a_two_way_sharded_extract_merges_to_the_single_job_rows(tmp_path: Path) -> None:
    single = execute(compose_stage("extract", tmp_path / "single", EXTRACT), extract_run)
    shards = ["extract.num_shards=2"]
    for k in range(2):
        part = execute(
            compose_stage("extract", tmp_path / f"p{k}", [*EXTRACT, *shards, f"extract.shard_index={k}"]), extract_run
        )
        assert part["documents_done"] == 2
        statuses = [d["status"] for d in json.loads((tmp_path / f"p{k}" / "manifest.json").read_text())["documents"]]
        assert statuses == (["done"] * 2 + ["other_job"] * 2)[:: 1 if k == 0 else -1]
    with pytest.raises(KVResearchError, match=r"Cannot merge: 2 of 2 extract parts are not finished"):
        execute(compose_stage("extract", tmp_path / "alone", [*EXTRACT, *shards]), extract_run)
    parts = f"extract.parts=[{tmp_path / 'p0'},{tmp_path / 'p1'}]"
    merged = execute(compose_stage("extract", tmp_path / "merged", [*EXTRACT, *shards, parts]), extract_run, verify)
    assert merged["documents_done"] == single["documents_done"] == 4 and merged["samples"] == single["samples"]
    strict = json.loads((tmp_path / "merged" / "metrics.json").read_text(), parse_constant=_not_json)
    assert strict["tokens_per_s"] is None  # a merge extracts nothing: null, never NaN
    assert (merged["shards"], single["shards"]) == (
        2,
        2,
    )  # other boundaries: documents [0, 1], [2, 3] vs [0, 1, 2], [3]
    for a, b in zip(all_rows(tmp_path / "single"), all_rows(tmp_path / "merged"), strict=True):
        assert (a == b).all() if isinstance(a, np.ndarray) else torch.equal(a, b)
    manifests = [json.loads((tmp_path / f / "manifest.json").read_text()) for f in ("single", "merged")]
    assert manifests[0]["documents"] == manifests[1]["documents"]
    assert all(manifests[0][k] == manifests[1][k] for k in ("model", "layout", "corpus", "rows"))


def test_a_two_way_sharded_evaluation_merges_to_the_single_job_metrics(tmp_path: Path) -> None:
    base, snapkv = tuple(SMALL_EVAL), ("method=snapkv", "method.keep_ratio=0.5")
    full = single_full(tmp_path)
    single = evaluate(tmp_path, *snapkv, base=base)
    for k in range(2):
        part = evaluate(tmp_path, *snapkv, "evaluate.num_shards=2", f"evaluate.shard_index={k}", base=base)
        assert part["overall"]["samples"] == 2
        assert part["reference_run"] == full and part["full_answers_from"] == {"reference_run": 2}
    merged = evaluate(tmp_path, *snapkv, "evaluate.num_shards=2", base=base)
    assert "evaluate.num_shards=2" in merged["run"]["overrides"] and len(merged["merged_parts"]) == 2
    assert merged["method"] == single["method"] and merged["reference_run"] == full
    timing = ("compress_s", "decode_s")
    blocks = [{"overall": m["overall"], **m["tasks"]} for m in (single, merged)]
    assert blocks[0].keys() == blocks[1].keys() and len(blocks[0]) == 3
    for name in blocks[0]:
        one, two = ({k: v for k, v in b[name].items() if k not in timing} for b in blocks)
        assert one == two, name
    folder = tmp_path / "evaluate"
    fields = ("id", "prediction", "score", "prune_ratio", "full_answer_nll")
    answers = [[{k: r[k] for k in fields} for r in lines(folder / m["run"]["name"])] for m in (single, merged)]
    assert answers[0] == answers[1] and len(answers[0]) == 4
    with pytest.raises(KVResearchError, match=r"Cannot merge: 2 of 2 evaluate parts are not finished"):
        evaluate(tmp_path, "method=streaming_llm", "method.keep_ratio=0.5", "evaluate.num_shards=2", base=base)


def stage(name: str, *args: str) -> str:
    """Run a stage as a user does (``python -m``, Hydra's command line); its output on success."""
    result = subprocess.run(
        [sys.executable, "-m", f"kvresearch.stages.{name}", *args],
        cwd=CONF_DIR.parent,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.mark.slow
def test_launchers_run_extract_train_and_evaluate_as_jobs(tmp_path: Path) -> None:
    """submitit's local executor (the SLURM code path) and joblib run a small pipeline end to end."""
    root = f"paths.root={tmp_path}"
    corpus = TINY
    # Two extract parts as two submitit jobs, then the merge; training as a joblib sweep of two surrogates.
    log = stage(
        "extract", "-m", "hydra/launcher=local", *corpus, "extract.num_shards=2", "extract.shard_index=0,1", root
    )
    assert "Submitit 'local' sweep" in log
    stage("extract", *corpus, "extract.num_shards=2", root)
    merged = next(p.parent for p in (tmp_path / "extract").glob("*/DONE") if "shard_index" not in p.parent.name)
    merged_metrics = json.loads((merged / "metrics.json").read_text())
    assert merged_metrics["documents_done"] == 4
    train = ["surrogate.epochs=1", "surrogate.batch_size=32", f"paths.extract={merged_metrics['run']['id']}", root]
    log = stage(
        "train_surrogate", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "surrogate=linear,mlp", *train
    )
    assert "Joblib.Parallel" in log
    runs = {p.parent.name.split("surrogate=")[-1]: p.parent for p in (tmp_path / "train_surrogate").glob("*/DONE")}
    assert set(runs) == {"linear", "mlp"}
    # Evaluation as two submitit jobs (full cache, KVzap with the trained MLP); resubmitting skips both.
    mlp = json.loads((runs["mlp"] / "metrics.json").read_text())["run"]["id"]  # names hold "=": ids
    evaluate = ["-m", "hydra/launcher=local", *SMALL, f"paths.surrogate_mlp={mlp}", root]
    stage("evaluate", *evaluate, "method=full,kvzap_mlp")
    done = sorted((tmp_path / "evaluate").glob("*/DONE"))
    assert len(done) == 2
    metrics = [json.loads((p.parent / "metrics.json").read_text()) for p in done]
    assert {m["method"]["name"] for m in metrics} == {"full", "kvzap_mlp"}
    stamps = [p.stat().st_mtime_ns for p in done]
    stage("evaluate", *evaluate, "method=full,kvzap_mlp")
    assert [p.stat().st_mtime_ns for p in done] == stamps  # finished runs skipped on resubmission


def test_the_pipeline_plan_waits_for_each_hand_off_and_names_the_runs_hydra_writes() -> None:
    from kvresearch.experiment import pipeline

    jobs = {j.name: j for j in pipeline.plan(3, ["model=tiny_random"], {"extract": ["extract.max_docs=6"]})}
    assert jobs["merge"].after == ["extract-0", "extract-1", "extract-2"]
    assert jobs["train-mlp"].after == ["merge"] and jobs["evaluate-full"].after == ["train-linear", "train-mlp"]
    assert jobs["evaluate-0"].after == ["evaluate-full"] and jobs["tables"].after[0] == "evaluate-full"
    # The run ids handed on are those of the folders the stages write, as Hydra names them.
    merge = jobs["merge"].command[3:]
    cfg = compose_stage("extract", None, merge)
    handed = next(a for a in jobs["train-mlp"].command if a.startswith("paths.extract="))
    assert handed == f"paths.extract={run_id(Path(cfg.out_dir))}"
    train = compose_stage("train_surrogate", None, jobs["train-mlp"].command[3:])
    sweep = " ".join(jobs["evaluate-0"].command)
    assert f"paths.surrogate_mlp={run_id(Path(train.out_dir))}" in sweep and "method=kvzap_mlp" in sweep
    assert "paths.surrogate" not in " ".join(jobs["evaluate-full"].command)  # the reference run's name stays plain
    full = jobs["evaluate-full"].command
    assert "model=tiny_random" in full and "model=smollm2_135m" not in full  # the command line's model wins
    assert (
        "method.calibrate=true" in sweep and "method.keep_ratio=0.5" in sweep
    )  # the cells of the experiment (kvzap_ruler's twin)
