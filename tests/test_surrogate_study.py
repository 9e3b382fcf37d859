"""kvresearch/studies/surrogates.py's bookkeeping: the learning curve's sizes, views per extract, one run per point."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from kvresearch.runs import run_folder, today
from kvresearch.runs.changes import resolved
from kvresearch.studies import surrogates as study
from kvresearch.surrogate.data import ExtractRun
from tests.helpers import compose_stage, synthetic_extract

SOURCES = ("essays", "wiki", "bible")


@pytest.mark.parametrize("n", [1, 15, 22, 23, 60, 129, 1980, 2114])
def test_the_curve_doubles_from_15_and_ends_at_every_document(n: int) -> None:
    sizes = study.curve_sizes(n)
    assert sizes[-1] == n and sizes == sorted(set(sizes))
    assert all(b == 2 * a for a, b in itertools.pairwise(sizes[:-1]))  # doubling before the last
    if len(sizes) > 1:
        assert sizes[0] == 15 and 1.5 * sizes[-2] <= n < 3 * sizes[-2]  # no near-duplicate of the last point


def test_the_study_runs_on_the_extract_its_tables_were_measured_on(tmp_path: Path) -> None:
    cfg = compose_stage("extract", None, [*study.STUDY_EXTRACT, f"paths.root={tmp_path}"])
    assert (cfg.corpus.n_train_per_source, cfg.corpus.n_test_per_source, cfg.extract.samples_per_doc) == (60, 8, 500)
    assert cfg.out_dir == str(run_folder(tmp_path, "extract", study.STUDY_EXTRACT))  # the folder it then reads
    default = compose_stage("extract", None, [])
    assert default.corpus.n_train_per_source == 30 and default.extract.samples_per_doc is None  # what it chose


def extract(folder: Path, seed: int, n_docs: int = 30) -> Path:
    """A synthetic finished extract whose documents take the three sources in turn."""
    manifest = synthetic_extract(folder, lambda h: h[..., :2], 2, 8, 2, n_docs=n_docs, rows=4, seed=seed)
    for doc in manifest["documents"]:
        doc["source"] = SOURCES[doc["index"] % 3]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_views_of_two_extracts_never_share_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRESEARCH_OUTPUTS", str(tmp_path / "outputs"))
    a, b = extract(tmp_path / "a", seed=0), extract(tmp_path / "b", seed=1)
    ids = [study.view(source, "curve-15", {"d1", "d2"}, {"d0"}) for source in (a, b)]
    assert ids[0] != ids[1]
    folders = sorted((tmp_path / "outputs" / "extract").iterdir())
    assert len(folders) == 2
    for folder in folders:
        run = ExtractRun(folder)  # a finished run that training opens, its shards those of its source
        splits = run.split_documents(val_fraction=0.0, seed=0)
        assert splits["train"] | splits["val"] == {1, 2} and splits["test"] == {0}
        h, _ = run.fetch(run.rows_of({0}))
        source = a if folder.name.startswith(f"study-{study.run_id(a)}") else b
        h_source, _ = ExtractRun(source).fetch(ExtractRun(source).rows_of({0}))
        assert torch.equal(h, h_source)


def test_a_view_is_stamped_by_its_source_and_its_documents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A train_surrogate run records the view's DONE: a redone source or another choice of documents changes it."""
    monkeypatch.setenv("KVRESEARCH_OUTPUTS", str(tmp_path / "outputs"))
    source = extract(tmp_path / "a", seed=0)
    (source / "DONE").write_text("2026-12-01T10:00:00\n")

    def done_of(train: set[str]) -> str:
        study.view(source, "t", train, {"d0"})
        return next((tmp_path / "outputs" / "extract").glob("*/DONE")).read_text()

    first = done_of({"d1", "d2"})
    assert done_of({"d1", "d2"}) == first  # rebuilt the same: the same stamp
    assert done_of({"d1"}) != first  # other documents
    (source / "DONE").write_text("2026-12-02T10:00:00\n")  # the source redone
    assert done_of({"d1", "d2"}) != first


def test_the_curve_trains_prefixes_of_the_other_sources_and_its_end_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRESEARCH_OUTPUTS", str(tmp_path / "outputs"))
    source = extract(tmp_path / "full", seed=0, n_docs=150)  # 100 wiki and bible documents, 50 essays
    trained: list[tuple[str, str]] = []

    def fake_train(extract_id: str, kind: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:  # no fit: bookkeeping
        trained.append((extract_id, kind))
        folder = next(p for p in (tmp_path / "outputs" / "extract").iterdir() if study.run_id(p) == extract_id)
        docs = json.loads((folder / "manifest.json").read_text())["documents"]
        train = [d for d in docs if d["status"] == "done" and d["split"] == "train"]
        test = [d for d in docs if d["status"] == "done" and d["split"] == "test"]
        (left,) = {d["source"] for d in test}  # one source left out, tested on all of it, none of it trained on
        sources = [d["source"] for d in train]
        assert left not in sources and len(test) == 50
        a, b = (s for s in SOURCES if s != left)
        assert abs(sources.count(a) - sources.count(b)) <= 1  # a prefix of the two others in turn
        fit = {"rows": 4 * len(test), "r2_per_layer": [len(train) / 100], "r2_mean": 0, "spearman_mean": 0}
        rows = {"train": 4 * len(train), "val": 0}
        return {"documents": {"train": len(train)}, "rows": rows, "train_s": 0, "test": fit}

    monkeypatch.setattr(study, "train", fake_train)
    results = study.points(source, ["loso", "curve"], None)
    assert len(trained) == len(set(trained))  # the curve's last point is the loso run, trained once
    essays = [r for r in results if r["left_out"] == "essays"]
    assert sorted({r["train_docs"] for r in essays}) == study.curve_sizes(100) == [15, 30, 60, 100]
    assert len(essays) == 2 * 4 and all(r["test_rows"] == 4 * 50 for r in essays)
    out = tmp_path / "docs"
    out.mkdir()
    study.write(results, out, "curve_all")
    table = (out / "curve_all.md").read_text()
    assert table.count("| curve |") == 6 and (out / "curve_all_curve.png").stat().st_size > 0


def test_the_recipe_part_changes_one_setting_per_point_and_draws_no_curve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRESEARCH_OUTPUTS", str(tmp_path / "outputs"))
    source = extract(tmp_path / "full", seed=0, n_docs=30)
    trained: list[tuple[str, str, tuple[str, ...]]] = []

    def fake_train(extract_id: str, kind: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:  # no fit: bookkeeping
        trained.append((extract_id, kind, extra))
        fit = {"rows": 1, "r2_per_layer": [len(trained) / 100], "r2_mean": 0, "spearman_mean": 0}
        return {"documents": {"train": 20}, "rows": {"train": 20, "val": 0}, "train_s": 0, "test": fit}

    monkeypatch.setattr(study, "train", fake_train)
    results = study.points(source, ["recipe"], None)
    assert len(trained) == len(set(trained)) and {kind for _, kind, _ in trained} == {"mlp"}
    # every point is the reference recipe with one change: its weight decay, or the reference's and one override
    for _, _, extra in trained:
        weight_decay = len(extra) == 1 and extra[0].startswith("surrogate.weight_decay=")
        assert weight_decay or (extra[0] == study.REFERENCE and len(extra) <= 2), extra
    by_source = {s: [r["recipe"] for r in results if r["left_out"] == s] for s in SOURCES}
    assert by_source["essays"] == ["reference", *(label for label, _ in study.RECIPES)]
    assert by_source["wiki"] == by_source["bible"] == ["reference", study.RECIPE_CHECKED]
    study.write(results, tmp_path, "recipe")
    assert (tmp_path / "recipe.md").read_text().count("| recipe | mlp |") == len(study.RECIPES) + 5
    assert not (tmp_path / "recipe_curve.png").exists()


def test_finished_only_tabulates_the_finished_points_and_marks_the_others_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A curve stopped part-way: the linear runs finished, the MLP's not; nothing is trained."""
    monkeypatch.setenv("KVRESEARCH_OUTPUTS", str(tmp_path / "outputs"))
    source = extract(tmp_path / "full", seed=0, n_docs=150)

    def read_finished(extract_id: str, kind: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        assert kind == "linear", "an unfinished run was trained"
        fit = {"rows": 200, "r2_per_layer": [0.61, 0.63], "r2_mean": 0.5, "spearman_mean": 0.7}
        return {"documents": {"train": 15}, "rows": {"train": 60, "val": 0}, "train_s": 3, "test": fit}

    monkeypatch.setattr(study, "finished", lambda extract_id, kind, extra=(): kind == "linear")
    monkeypatch.setattr(study, "train", read_finished)
    results = study.points(source, ["curve"], None, finished_only=True)
    assert [r["kind"] for r in results] == ["linear", "mlp"] * 4
    assert all((r["r2_pooled_per_layer"] is None) == (r["kind"] == "mlp") for r in results)
    study.write(results, tmp_path, "partial")
    rows = (tmp_path / "partial.md").read_text().splitlines()[4:]
    assert len(rows) == 8 and all(row.endswith("| 0.620 | 0.500 | 0.700 | 3 |") for row in rows[0::2])
    assert all(row.endswith("| not run | not run | not run | not run |") for row in rows[1::2])
    assert (tmp_path / "partial_curve.png").stat().st_size > 0  # drawn from the finished points only


def test_finished_reads_the_run_folder_a_real_run_would_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRESEARCH_OUTPUTS", str(tmp_path / "outputs"))
    assert not study.finished("abc123", "mlp")
    folder, overrides = study._run("abc123", "mlp", ())
    assert folder == run_folder(tmp_path / "outputs", "train_surrogate", ["paths.extract=abc123", "surrogate=mlp"])
    folder.mkdir(parents=True)
    (folder / "DONE").write_text("2026-12-04T10:00:00\n")
    cfg = today("train_surrogate", overrides)
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(resolved(cfg))))  # as a run stores it
    assert study.finished("abc123", "mlp")  # what a re-run would skip
    cfg.surrogate.lr = 2 * cfg.surrogate.lr
    (folder / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(resolved(cfg))))  # as a run stores it
    assert not study.finished("abc123", "mlp")  # finished with other settings: a re-run trains it again
