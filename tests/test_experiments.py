"""Experiments (conf/experiment/): every config composes; run folders as Hydra names them; tables from run folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from kvresearch import experiment as experiments
from kvresearch.errors import KVResearchError
from kvresearch.runs import CONF_DIR, repo_root
from kvresearch.runs.steps import step_run
from kvresearch.stats import bootstrap_mean, paired_difference
from tests.helpers import SMALL_RULER, compose_stage, surrogate_run

CLI = ["-m", "kvresearch.experiment"]


@pytest.mark.parametrize("name", experiments.names())
def test_every_experiment_config_composes_for_each_model_and_row(name: str, tmp_path: Path) -> None:
    exp = experiments.load(name)
    for variant in ("twin", "hub"):
        seen = set()
        for cell in experiments.cells(exp, variant):
            if (cell.model, cell.row) in seen:
                continue
            seen.add((cell.model, cell.row))
            cfg = compose_stage(cell.stage, None, list(cell.overrides))  # unknown keys or groups raise here
            if cell.stage == "evaluate":
                source = cfg.model.source
                assert (source == "hub") == (variant == "hub"), (name, variant, cell.model)
        for step in experiments.steps(exp, variant):  # a step's hand-off to another step resolves to its folder
            compose_stage(step.stage, None, list(step.overrides))
            for ref in [o.split("=", 1)[1] for o in step.overrides if o.startswith("paths.")]:
                stage, folder = step_run(*ref.split(":"), tmp_path)
                assert folder.parent == tmp_path / stage, (name, step.name, ref)
    if experiments.cells(exp, "twin") and exp.get("kind", "curve") == "curve":
        assert experiments.cells(exp, "twin")[0].reference  # the full-cache row comes first


def test_an_unknown_experiment_names_the_known_ones() -> None:
    with pytest.raises(KVResearchError, match="kvzap_ruler"):
        experiments.load("kvzap_rule")


def write_experiment(path: Path, surrogate: Path, extra_row: bool = False) -> Path:
    rows = [
        {"method": "full", "reference": True},
        {"method": "streaming_llm", "sweep": {"method.keep_ratio": [0.5]}},
        {"method": "kvzap_linear", "overrides": [f"paths.surrogate_linear={surrogate}", "method.calibrate=true"],
         "sweep": {"method.keep_ratio": [0.6]}},
    ]  # fmt: skip
    if extra_row:
        rows.append({"method": "snapkv", "sweep": {"method.keep_ratio": [0.25]}})
    shared = [o for o in SMALL_RULER if not o.startswith("model=")] + ["evaluate.calibration_samples=2"]
    variant = {"models": ["tiny_random"], "shared": shared, "rows": rows}
    spec = {"title": "test", "paper": "none", "stage": "evaluate", "variants": {"twin": variant, "hub": variant}}
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.slow
def test_run_then_table_reads_hydra_run_folders_and_prints_not_run_for_missing_cells(tmp_path: Path, tiny) -> None:
    from kvresearch.models import ModelAdapter

    adapter = ModelAdapter(tiny.model)
    surrogate_run(tmp_path / "out" / "surrogate", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads,
                  kind="linear")  # fmt: skip
    env = {**os.environ, "KVRESEARCH_OUTPUTS": str(tmp_path / "out")}
    spec = write_experiment(tmp_path / "fixture_xyz.yaml", tmp_path / "out" / "surrogate")
    run = subprocess.run([sys.executable, *CLI, "run", str(spec)], env=env, capture_output=True, text=True,
                         cwd=repo_root())  # fmt: skip  # logged to W&B (offline), grouped per experiment
    assert run.returncode == 0, run.stderr[-2000:]
    assert "3 runs to start" in run.stdout
    # A fourth row added afterwards has no run: the table says so, the finished cells give their numbers.
    write_experiment(spec, tmp_path / "out" / "surrogate", extra_row=True)
    args = ["table", str(spec), "--out", str(tmp_path / "tables"), "--root", str(tmp_path / "out"), "--no-wandb"]
    table = subprocess.run([sys.executable, *CLI, *args], env=env, capture_output=True, text=True)
    assert table.returncode == 0, table.stderr[-2000:]
    text = (tmp_path / "tables" / "fixture_xyz_twin.md").read_text()
    rows = {line.split(" | ")[1]: line.strip("| ").split(" | ") for line in text.splitlines() if "tiny_random" in line}
    assert rows["snapkv"][3:] == ["not run"] * 4
    assert "3 of 4 cells finished" in text and "not run" in (tmp_path / "tables" / "fixture_xyz_twin.tex").read_text()
    for suffix in (".png", ".pdf"):
        assert (tmp_path / "tables" / f"fixture_xyz_twin{suffix}").stat().st_size > 1000
    # The numbers are the run folders' own: the interval and the paired difference recomputed directly.
    exp = experiments.load(str(spec))
    cells = {c.row: c for c in experiments.cells(exp, "twin")}
    scores = {}
    for name in ("full", "streaming_llm", "kvzap_linear"):
        folder = cells[name].folder(tmp_path / "out")
        assert (folder / "DONE").is_file(), folder  # Hydra named the run as the cell expects (W&B keys left out)
        records = next(folder.glob("wandb/offline-run-*/run-*.wandb")).read_bytes()
        assert b"predictions" in records and b"fixture_xyz" in records  # the predictions Table, the experiment's group
        records = [json.loads(x) for x in (folder / "predictions.jsonl").read_text().splitlines()]
        scores[name] = {r["id"]: r["score"] for r in records}
    ci = bootstrap_mean(list(scores["streaming_llm"].values())).scaled(100)
    diff = paired_difference(*[[scores[n][i] for i in sorted(scores["full"])] for n in ("streaming_llm", "full")])
    assert rows["streaming_llm"][5] == f"{ci.mean:.1f} [{ci.low:.1f}, {ci.high:.1f}]"
    assert rows["streaming_llm"][6] == f"{diff.mean * 100:+.1f} [{diff.low * 100:+.1f}, {diff.high * 100:+.1f}]"
    assert "tau=" in rows["kvzap_linear"][2]  # the calibrated threshold is shown with its target
    # A re-run finds nothing left but the new row.
    again = subprocess.run([sys.executable, *CLI, "run", str(spec), "--no-wandb", "--print"], env=env,
                           capture_output=True, text=True, cwd=repo_root())  # fmt: skip
    assert "1 runs to start" in again.stdout and "snapkv" in again.stdout
    # A finished cell whose stored settings differ from today's config (a default changed since) is not reused
    # silently: the runner lists it, and redoes it or keeps it only when told.
    stored = cells["streaming_llm"].folder(tmp_path / "out") / "config.yaml"
    stored.write_text(stored.read_text().replace("max_new_tokens: 8", "max_new_tokens: 9"))
    base = [sys.executable, *CLI, "run", str(spec), "--no-wandb", "--print"]
    printed = lambda *flags: subprocess.run([*base, *flags], env=env, capture_output=True, text=True, cwd=repo_root())
    refused = printed()
    assert refused.returncode != 0 and "0 cells" not in refused.stdout
    assert "1 runs of" in refused.stderr and "streaming_llm" in refused.stderr
    assert "evaluate.max_new_tokens: 9 -> 8" in refused.stderr and "--on-config-change redo" in refused.stderr
    kept = printed("--on-config-change", "keep")
    assert kept.returncode == 0 and "1 runs to start" in kept.stdout and "streaming_llm" not in kept.stdout
    redone = printed("--on-config-change", "redo")
    assert redone.returncode == 0 and "2 runs to start" in redone.stdout
    assert [line for line in redone.stdout.splitlines() if "force=true" in line] == [
        line for line in redone.stdout.splitlines() if "method=streaming_llm" in line
    ]
    # The table still shows the cell's numbers, marked, with what differs listed under it.
    table = subprocess.run([sys.executable, *CLI, *args], env=env, capture_output=True, text=True)
    assert table.returncode == 0, table.stderr[-2000:]
    text = (tmp_path / "tables" / "fixture_xyz_twin.md").read_text()
    marked = [line for line in text.splitlines() if "(changed)" in line and line.startswith("|")]
    assert len(marked) == 1 and "| streaming_llm (changed) |" in marked[0]
    assert "- tiny_random streaming_llm keep_ratio=0.5: evaluate.max_new_tokens: 9 -> 8" in text


def test_configs_in_conf_experiment_name_models_that_exist() -> None:
    models = {p.stem for p in (CONF_DIR / "model").glob("*.yaml")}
    for name in experiments.names():
        spec = yaml.safe_load((CONF_DIR / "experiment" / f"{name}.yaml").read_text())
        for variant in spec["variants"].values():
            for entry in variant.get("models") or []:
                assert (entry if isinstance(entry, str) else entry["name"]) in models, (name, entry)


def test_with_no_finished_run_every_cell_prints_not_run_and_no_number(tmp_path: Path) -> None:
    for name in ("kvzap_ruler", "kvzap_surrogate_r2"):
        header, rows, points = experiments.table(experiments.load(name), "twin", tmp_path)
        assert rows and points == [] and all(r[3:] == ["not run"] * (len(header) - 3) for r in rows)
        text = experiments.markdown(header, rows)
        assert not any(ch.isdigit() for line in text.splitlines()[2:] for ch in line.split("|", 4)[-1])


def test_a_decoding_experiment_plots_the_ratio_at_the_end_of_the_generation(tmp_path: Path) -> None:
    exp = experiments.load("kvzap_aime25")  # pruned while decoding: nothing is evicted at prefill
    cells = experiments.cells(exp, "twin")
    end = {cell: 0.0 if cell.reference else 0.2 + 0.1 * i for i, cell in enumerate(cells)}  # distinct per cell
    for cell in cells:
        folder = cell.folder(tmp_path)
        folder.mkdir(parents=True)
        overall = {"prune_ratio": 0.0, "decode_prune_ratio": end[cell]}
        (folder / "metrics.json").write_text(json.dumps({"overall": overall}))
        (folder / "predictions.jsonl").write_text(json.dumps({"id": "a", "score": 1.0}) + "\n")
        (folder / "DONE").touch()
    header, rows, points = experiments.table(exp, "twin", tmp_path)
    assert header[4] == "decode prune ratio"
    for row, point, cell in zip(rows, points, cells, strict=True):
        assert row[4] == f"{end[cell]:.3f}" and point["x"] == pytest.approx(end[cell])
    exp.ratio = "kept_ratio"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(OmegaConf.to_container(exp)))
    with pytest.raises(KVResearchError, match="ratio must be one of"):
        experiments.load(str(bad))


def test_rows_pick_cells_in_the_order_given_with_each_full_cache_row_first() -> None:
    cells = experiments.cells(experiments.load("ruler_resolved"), "twin")
    chosen = experiments.select(cells, ["kvzip_plus", "kvzap_mlp@keep_ratio=0.5"])
    expected = [("full", ""), ("kvzip_plus", "keep_ratio=0.5"), ("kvzip_plus", "keep_ratio=0.25"),
                ("kvzap_mlp", "keep_ratio=0.5")]  # fmt: skip
    assert [(c.model, c.row, c.point) for c in chosen] == [
        (model, row, point) for model in ("smollm2_135m 2k", "smollm2_135m 4k") for row, point in expected
    ]  # 2k before 4k
    assert experiments.select(cells, None) == cells
    with pytest.raises(KVResearchError, match="rows: full, kvzap_mlp"):
        experiments.select(cells, ["kvzap"])
    with pytest.raises(KVResearchError, match=r"snapkv \(@keep_ratio=0.5 @keep_ratio=0.25\)"):
        experiments.select(cells, ["snapkv@method.keep_ratio=0.5"])  # the point is named as the table names it
    only_2k = experiments.select(cells, ["kvzap_mlp@keep_ratio=0.5"], ["smollm2_135m 2k"])
    assert [(c.model, c.row, c.point) for c in only_2k] == [
        ("smollm2_135m 2k", "full", ""), ("smollm2_135m 2k", "kvzap_mlp", "keep_ratio=0.5")]  # fmt: skip
    with pytest.raises(KVResearchError, match="models: smollm2_135m 2k, smollm2_135m 4k"):
        experiments.select(cells, None, ["smollm2_135m"])


def test_two_entries_of_one_model_are_paired_with_their_own_full_cache(tmp_path: Path) -> None:
    exp = experiments.load("ruler_resolved")  # 2k and 4k: one model, two labelled entries
    plant = {("smollm2_135m 2k", "full"): 1.0, ("smollm2_135m 4k", "full"): 0.0,
             ("smollm2_135m 2k", "snapkv"): 1.0, ("smollm2_135m 4k", "snapkv"): 0.0}  # fmt: skip
    folders = set()
    for cell in experiments.cells(exp, "twin"):
        if (cell.model, cell.row) not in plant or cell.point == "keep_ratio=0.25":
            continue
        folder = cell.folder(tmp_path)
        folders.add(folder)
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({"overall": {"prune_ratio": 0.0 if cell.reference else 0.5}}))
        score = plant[cell.model, cell.row]
        (folder / "predictions.jsonl").write_text("".join(json.dumps({"id": i, "score": score}) + "\n" for i in "ab"))
        (folder / "DONE").touch()
    assert len(folders) == 4  # each entry's cells have run folders of their own
    _, rows, _ = experiments.table(exp, "twin", tmp_path)
    snapkv = [r for r in rows if r[1] == "snapkv" and r[3] != "not run"]
    got = [(r[0], r[5].split()[0], r[6].split()[0]) for r in snapkv]  # mean, and the difference against full
    assert got == [("smollm2_135m 2k", "100.0", "+0.0"), ("smollm2_135m 4k", "0.0", "+0.0")]  # not +/-100


def test_extra_metrics_get_their_mean_and_paired_difference_against_the_full_cache(tmp_path: Path) -> None:
    rows = [{"method": "full", "reference": True}, {"method": "am_omp", "sweep": {"method.keep_ratio": [0.1]}}]
    variant = {"models": ["smollm2_135m"], "shared": ["benchmark=quality"], "rows": rows}
    spec = {"title": "t", "paper": "p", "variants": {"twin": variant, "hub": variant},
            "also": {"agrees_with_full": {"scale": 100, "digits": 1}, "full_answer_nll": None}}  # fmt: skip
    (tmp_path / "also.yaml").write_text(yaml.safe_dump(spec))
    exp = experiments.load(str(tmp_path / "also.yaml"))
    planted = {"full": ([1.0] * 4, [0.2, 0.4, 0.1, 0.3]), "am_omp": ([1.0, 0.0, 1.0, 0.0], [0.5, 0.9, 0.2, 0.8])}
    for cell in experiments.cells(exp, "twin"):
        folder = cell.folder(tmp_path / "out")
        folder.mkdir(parents=True)
        (folder / "metrics.json").write_text(json.dumps({"overall": {"prune_ratio": 0.9}}))
        agree, nll = planted[cell.row]
        lines = [{"id": str(i), "score": 0.25, "agrees_with_full": a, "full_answer_nll": n}
                 for i, (a, n) in enumerate(zip(agree, nll, strict=True))]  # fmt: skip
        (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        (folder / "DONE").touch()
    header, table_rows, points = experiments.table(exp, "twin", tmp_path / "out")
    assert header[7:] == ["agrees_with_full [95% CI]", "agrees_with_full vs full", "full_answer_nll [95% CI]",
                          "full_answer_nll vs full"]  # fmt: skip
    full, am = table_rows
    agree_ci = bootstrap_mean(planted["am_omp"][0]).scaled(100)
    nll_diff = paired_difference(planted["am_omp"][1], planted["full"][1])
    assert am[7] == f"{agree_ci.mean:.1f} [{agree_ci.low:.1f}, {agree_ci.high:.1f}]" == "50.0 [0.0, 100.0]"
    assert am[10] == f"{nll_diff.mean:+.3f} [{nll_diff.low:+.3f}, {nll_diff.high:+.3f}]"
    assert am[10].startswith("+0.350") and full[8] == full[10] == ""  # the reference has no difference
    assert points[1]["also"]["agrees_with_full"] == agree_ci  # the figure's extra panels plot the same numbers
    assert points[1]["also"]["full_answer_nll"].mean == pytest.approx(0.6)


def test_a_single_ratio_table_plots_its_rows_side_by_side_and_a_curve_against_the_ratio() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvresearch.experiment import figures as cli

    m = bootstrap_mean([0.0, 1.0, 1.0])
    full = {"row": "full", "x": 0.0, "mean": m, "reference": True}
    ablation = [full, *({"row": r, "x": 0.937 + 0.001 * i, "mean": m} for i, r in enumerate(["a", "b", "c"]))]
    curve = [full, *({"row": r, "x": x, "mean": m} for r in ("c", "a") for x in (0.5, 0.75))]
    rows = ["a", "b", "c"]  # the figure's rows: a is C0, c is C2 in every panel
    fig, (left, right) = plt.subplots(1, 2)
    assert cli.curve_panel(left, ablation, None, rows) == pytest.approx(0.938)
    assert [t.get_text() for t in left.get_xticklabels()] == ["a", "b", "c"]
    assert cli.curve_panel(right, curve, None, rows) is None  # two ratios: the x-axis is the prune ratio
    assert right.get_xlim()[0] < 0.5 < 0.75 < right.get_xlim()[1]
    # a row keeps its colour in a panel that lacks another row, and comes first there
    handles, labels = right.get_legend_handles_labels()
    pairs = zip(handles, labels, strict=True)
    drawn = {label: matplotlib.colors.to_hex(h[0].get_color()) for h, label in pairs if label != "full"}
    assert drawn == {"c": matplotlib.colors.to_hex("C2"), "a": matplotlib.colors.to_hex("C0")}
    plt.close(fig)
