"""Run records (kvresearch/runs/records.py): a table rebuilt on a machine that has none of the run folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvresearch import experiment as experiments
from kvresearch.errors import KVResearchError
from kvresearch.runs import records, repo_root
from kvresearch.stats import paired_difference
from tests.helpers import SMALL_RULER

CLI = ["-m", "kvresearch.experiment"]


def table_rows(path: Path) -> dict[str, list[str]]:
    """The table's rows by method (the model column left out)."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("| tiny_random")]
    return {line.split(" | ")[1]: line.strip("| ").split(" | ")[1:] for line in lines}


@pytest.mark.slow
def test_records_carry_a_table_and_a_reference_run_to_a_machine_without_the_run_folders(tmp_path: Path) -> None:
    rows = [{"method": "full", "reference": True}, {"method": "streaming_llm", "sweep": {"method.keep_ratio": [0.5]}},
            {"method": "snapkv", "sweep": {"method.keep_ratio": [0.25]}}]  # fmt: skip
    shared = [o for o in SMALL_RULER if not o.startswith("model=")]
    variant = {"models": ["tiny_random"], "shared": shared, "rows": rows}
    spec = tmp_path / "fixture_rec.yaml"
    spec.write_text(yaml.safe_dump({"title": "t", "paper": "p", "variants": {"twin": variant, "hub": variant}}))
    store = tmp_path / "records"

    def cli(machine: str, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KVRESEARCH_OUTPUTS": str(tmp_path / machine), "KVRESEARCH_RECORDS": str(store),
               records.DIRTY_ENV: "1"}  # fmt: skip  # a checkout being edited records too (with its diff)
        return subprocess.run([sys.executable, *CLI, *args], env=env, capture_output=True, text=True,
                              cwd=repo_root())  # fmt: skip

    def table(machine: str, out: str) -> str:
        made = cli(machine, "table", str(spec), "--root", str(tmp_path / machine), "--out", str(tmp_path / out),
                   "--no-wandb")  # fmt: skip
        assert made.returncode == 0, made.stderr[-2000:]
        return made.stdout

    # Machine a runs two cells; its table records them.
    ran = cli("a", "run", str(spec), "--rows", "streaming_llm", "--no-wandb")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "2 finished cells recorded" in table("a", "t1")
    cells = {c.row: c for c in experiments.cells(experiments.load(str(spec)), "twin")}
    paths = {row: records.path_of(store, cell.folder(tmp_path / "a")) for row, cell in cells.items()}
    assert paths["full"].is_file() and paths["streaming_llm"].is_file() and not paths["snapkv"].exists()
    folder = cells["streaming_llm"].folder(tmp_path / "a")
    kept = records.read(paths["streaming_llm"])
    assert kept is not None and kept["done"] == (folder / "DONE").read_text().strip()
    roots = {"outputs": str(tmp_path / "a"), "checkout": str(repo_root())}  # paths in a record are relative
    assert kept["metrics"] == records.portable(json.loads((folder / "metrics.json").read_text()), roots)
    assert kept["predictions"] == [json.loads(x) for x in (folder / "predictions.jsonl").read_text().splitlines()]
    stamp = paths["full"].stat().st_mtime_ns
    table("a", "t1")
    assert paths["full"].stat().st_mtime_ns == stamp  # the same run is not written again

    # Machine b has no run folder: the table is the same, and says where its cells came from.
    text = table("b", "t2")
    assert table_rows(tmp_path / "t2" / "fixture_rec_twin.md") == table_rows(tmp_path / "t1" / "fixture_rec_twin.md")
    assert "2 of 3 cells finished" in text and "Cells read from run records" in text
    assert "- tiny_random full: finished" in text and "- tiny_random streaming_llm keep_ratio=0.5: finished" in text
    printed = cli("b", "run", str(spec), "--no-wandb", "--print")
    assert "3 runs to start" in printed.stdout and "2 of these cells have run records" in printed.stdout
    skipping = cli("b", "run", str(spec), "--no-wandb", "--print", "--skip-recorded")
    assert "1 runs to start" in skipping.stdout and "snapkv" in skipping.stdout

    # The missing cell runs on b and takes its full-cache answers from the full cache's record.
    ran = cli("b", "run", str(spec), "--no-wandb", "--skip-recorded")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "full-cache answers from the run record" in ran.stdout
    snap = cells["snapkv"].folder(tmp_path / "b")
    answers = [json.loads(x) for x in (snap / "predictions.jsonl").read_text().splitlines()]
    assert {a["full_answer_from"] for a in answers} == {"reference_run"}
    full = records.read(paths["full"])
    assert full is not None
    inputs = json.loads((snap / "metrics.json").read_text())["inputs"]
    assert inputs == {f"evaluate/{cells['full'].folder(tmp_path).name}": full["done"]}
    text = table("b", "t3")
    got = table_rows(tmp_path / "t3" / "fixture_rec_twin.md")
    assert "3 of 3 cells finished" in text and "(changed)" not in text
    theirs = {a["id"]: a["score"] for a in full["predictions"]}
    diff = paired_difference([a["score"] for a in answers], [theirs[a["id"]] for a in answers])
    assert got["snapkv"][5] == f"{diff.mean * 100:+.1f} [{diff.low * 100:+.1f}, {diff.high * 100:+.1f}]"

    # A record made with other settings than today's config is marked, as a run folder would be.
    changed = dict(full, config={**full["config"], "evaluate": {**full["config"]["evaluate"], "max_new_tokens": 9}})
    paths["full"].write_text(json.dumps(changed))
    text = table("b", "t4")
    assert "| tiny_random | full (changed) |" in text and "evaluate.max_new_tokens: 9 -> 8" in text

    # A damaged record stops the table with its name and the way to restore it; it is never a finished cell.
    paths["full"].write_text(paths["full"].read_text()[:100])
    broken = cli("b", "table", str(spec), "--root", str(tmp_path / "b"), "--out", str(tmp_path / "t5"), "--no-wandb")
    assert broken.returncode != 0 and str(paths["full"]) in broken.stderr and "git checkout" in broken.stderr


def test_a_record_is_read_only_when_it_is_one(tmp_path: Path) -> None:
    assert records.read(tmp_path / "none.json") is None
    assert records.write(tmp_path / "evaluate" / "unfinished", tmp_path / "records") is None
    (tmp_path / "other.json").write_text(json.dumps({"format": 1, "stage": "evaluate"}))
    with pytest.raises(KVResearchError, match="missing"):
        records.read(tmp_path / "other.json")


def test_a_record_holds_no_machine_path_and_needs_a_clean_commit(tmp_path: Path) -> None:
    root, checkout = tmp_path / "outputs", tmp_path / "checkout"
    folder = root / "evaluate" / "method=full"
    folder.mkdir(parents=True)
    config = {"paths": {"root": str(root)}, "out_dir": str(folder), "budgets": f"{checkout}/conf/b.json", "seed": 0}
    (folder / "config.yaml").write_text(json.dumps(config))
    git = {"commit": "abc", "dirty": True, "diff_sha1": "f00", "diff": "+x\n"}
    (folder / "versions.json").write_text(json.dumps({"git": git, "checkout": str(checkout)}))
    (folder / "metrics.json").write_text(json.dumps({"inputs": {}, "extract_run": f"{root}/extract/default"}))
    (folder / "predictions.jsonl").write_text(json.dumps({"id": "q#0", "score": 1.0}) + "\n")
    (folder / "DONE").write_text("2026-12-06T00:00:00+00:00\n")
    store = tmp_path / "records"
    assert records.write(folder, store) is None  # made from uncommitted changes: not recorded
    written = records.write(folder, store, allow_dirty=True)
    assert written is not None
    text = written.read_text()
    assert str(tmp_path) not in text  # every path relative to the outputs root or the checkout
    record = records.read(written)
    assert record is not None and record["config"]["out_dir"] == "<outputs>/evaluate/method=full"
    assert record["config"]["budgets"] == "<checkout>/conf/b.json" and record["versions"]["git"]["diff"] == "+x\n"
    assert record["metrics"]["extract_run"] == "<outputs>/extract/default"
    git["dirty"] = False
    (folder / "versions.json").write_text(json.dumps({"git": git, "checkout": str(checkout)}))
    (folder / "DONE").write_text("2026-12-06T00:00:01+00:00\n")
    assert records.write(folder, store) == written  # a clean commit is recorded


@pytest.mark.slow
def test_every_committed_table_is_rebuilt_from_the_committed_run_records(tmp_path: Path) -> None:
    """What a fresh clone gets from `make table-<name>`: the committed Markdown and LaTeX, byte for byte."""
    committed = repo_root() / "docs" / "results" / "experiments"
    names = sorted({p.name.removesuffix("_twin.md") for p in committed.glob("*_twin.md")})
    assert "kvzap_ruler" in names and "am_quality_one" in names
    committed_records = repo_root() / "docs" / "results" / "runs"  # the suite's own records live elsewhere (conftest)
    env = {**os.environ, "KVRESEARCH_OUTPUTS": str(tmp_path / "empty"), "KVRESEARCH_RECORDS": str(committed_records)}
    for name in names:
        args = [sys.executable, *CLI, "table", name, "--out", str(tmp_path), "--no-record", "--no-wandb"]
        made = subprocess.run(args, env=env, capture_output=True, text=True, cwd=repo_root())
        assert made.returncode == 0, made.stderr[-2000:]
        for suffix in (".md", ".tex"):
            ours, theirs = tmp_path / f"{name}_twin{suffix}", committed / f"{name}_twin{suffix}"
            assert ours.read_text() == theirs.read_text(), f"{theirs.name} differs from its rebuild: make table-{name}"
    from kvresearch.experiment import index

    rebuilt = index.render(committed.parent, tmp_path / "empty", committed_records)
    assert rebuilt == (committed.parent / "README.md").read_text(), "python -m kvresearch.experiment index"
