"""One budget vocabulary: one ``decoding`` type for every method, renamed options migrated without a rerun.

Pure logic apart from composing configs: no model runs here (the behaviour under each option is tested in
test_decoding.py, test_calibration.py and test_am_variants.py).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvresearch import experiment as experiments
from kvresearch.errors import KVResearchError
from kvresearch.experiment import migrate as migrate_files
from kvresearch.methods.base import DecodingBudget
from kvresearch.runs import migrate
from kvresearch.runs import records as run_records
from kvresearch.runs.naming import MAX_NAME, run_folder
from tests.helpers import method_config

RECORDS = Path(__file__).resolve().parent.parent / "docs" / "results" / "runs"
RECOMPRESS, PRESS = ("interval", "target_size", "protect"), ("interval", "target_size")


def test_one_decoding_type_reads_the_fields_each_method_names() -> None:
    assert DecodingBudget.of(None, "m", RECOMPRESS) is None and DecodingBudget.of(False, "m", None) is None
    assert DecodingBudget.of(True, "am", RECOMPRESS) == DecodingBudget(512, 2048, 20)
    assert DecodingBudget.of(True, "snapkv", PRESS) == DecodingBudget(512, 2048, None)  # no protected tail
    assert DecodingBudget.of(True, "kvzap", ()) == DecodingBudget(None, None, None)  # the threshold at every step
    assert DecodingBudget.of({"interval": 8}, "am", RECOMPRESS) == DecodingBudget(8, 2048, 20)
    with pytest.raises(KVResearchError, match=r"decoding.protect is not read by this method; .* reads interval"):
        DecodingBudget.of({"protect": 4}, "snapkv", PRESS)
    with pytest.raises(KVResearchError, match="reads none of them"):
        DecodingBudget.of({"interval": 4}, "kvzap", ())
    with pytest.raises(KVResearchError, match="does not compress while decoding"):
        DecodingBudget.of(True, "full", None)
    with pytest.raises(KVResearchError, match="interval=0"):
        DecodingBudget.of({"interval": 0}, "am", RECOMPRESS)
    with pytest.raises(KVResearchError, match=r"protect \(8\) must be below target_size"):
        DecodingBudget.of({"target_size": 8, "protect": 8}, "am", RECOMPRESS)


def resolved(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=False)


def test_every_method_config_writes_decoding_the_same_way() -> None:
    for name in ("kvzap_mlp", "kvzip_plus", "am_omp", "snapkv"):
        assert method_config(name).decoding is None, name  # null everywhere: no compression while decoding
    assert method_config("kvzap_mlp", ["decoding=true"]).decoding is True


def flat_am(method: dict) -> dict:
    """Today's grouped AM options written back in the old flat layout (the inverse of the migration)."""
    old = {k: v for k, v in method.items() if k not in ("queries", "keys", "fit", "budgets")}
    for flat, (group, name) in migrate.AM_GROUPS.items():
        old[flat] = method[group][name]
    old["budgets"] = None if old["budgets"] == "uniform" else old["budgets"]
    return old


def test_old_layouts_migrate_to_exactly_todays_configs() -> None:
    for name in ("am_omp_fast_onpolicy", "top_attention", "am_highest_global_layer", "am_omp_budgets"):
        today = {"method": resolved(method_config(name))}
        assert migrate.config({"method": flat_am(today["method"])}) == (today, ["am-groups"]), name
    assert migrate.config(today) == (today, [])  # a config already in today's layout is left alone
    calibrated = {"method": resolved(method_config("kvzap_mlp", ["calibrate=true", "keep_ratio=0.25"]))}
    calibrated["method"]["threshold"] = None  # resolved: keep_ratio clears the threshold's default
    old = {**calibrated["method"], "calibrate_to": 0.75, "threshold": -4.0, "keep_ratio": None, "decoding": False}
    old.pop("calibrate")
    assert migrate.config({"method": old}) == (calibrated, ["decoding-type", "kvzap-calibrate"])
    before_sinks = {"method": {k: v for k, v in calibrated["method"].items() if k != "sinks"}}
    paper_rule = {"method": {**calibrated["method"], "sinks": 0}}  # what runs made before the option computed
    assert calibrated["method"]["sinks"] == 4 and migrate.config(before_sinks, added=True) == (paper_rule, [])
    assert migrate.config(before_sinks) == (before_sinks, [])  # an added option renames nothing: files keep it out


def test_overrides_migrate_and_go_back() -> None:
    old = ["benchmark=ruler", "method.calibrate_to=0.75", "method=kvzap_mlp", "method.fit_beta=false"]
    new = migrate.overrides(old)
    assert new == ["benchmark=ruler", "method.calibrate=true", "method.keep_ratio=0.25", "method=kvzap_mlp",
                   "method.fit.beta=false"]  # fmt: skip
    assert sorted(migrate.backward(new[:4])) == sorted(old[:3])


def test_a_record_under_the_old_name_is_renamed_to_its_cell(tmp_path: Path) -> None:
    """A kvzap_ruler cell's record planted under its old name (cut short with a hash) is found and renamed."""
    exp = experiments.load("kvzap_ruler")
    cell = next(c for c in experiments.cells(exp, "twin") if c.row == "kvzap_mlp" and c.point == "keep_ratio=0.25")
    today = run_records.path_of(RECORDS, cell.folder(Path("/")))
    old = run_records.path_of(tmp_path, run_folder(Path("/"), cell.stage, migrate.backward(cell.overrides)))
    assert len(old.stem) == MAX_NAME and "calibrate_to" not in old.stem  # cut short: only the cell can name it
    record = json.loads(today.read_text())
    planted = copy.deepcopy(record)
    method = planted["config"]["method"]
    method.update({"calibrate_to": 0.75, "keep_ratio": None, "threshold": -4.0, "decoding": False})
    method.pop("calibrate")
    old.parent.mkdir(parents=True)
    old.write_text(run_records.dump({k: v for k, v in planted.items() if k != "migrated"}))
    current = next(p for p in (RECORDS / "evaluate").glob("*am_omp*.json"))  # already in today's layout
    shutil.copy(current, old.parent / current.name)
    lines = list(migrate_files.records(tmp_path))
    assert len(lines) == 1 and "->" in lines[0] and not old.exists()  # the AM record is left as it is
    moved = json.loads(run_records.path_of(tmp_path, cell.folder(Path("/"))).read_text())
    record.pop("migrated", None)  # the committed record may come from a run made under today's names
    assert moved.pop("migrated") == ["decoding-type", "kvzap-calibrate"]  # the migration says what it renamed
    assert moved == record  # and the record is the run's, under today's names
