"""Every config in conf/ composes with every stage that uses its group; every method builds and compresses on
the tiny model; the README's sweep examples run as written (on the tiny model)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kvresearch.models import ModelAdapter, Session
from kvresearch.models.press_catalog import CATALOG
from kvresearch.prompts import build_prompt
from kvresearch.runs import CONF_DIR, build
from tests.helpers import budgets_run, compose_stage, method_config, surrogate_run, synthetic_extract

STAGES = ["needle", "extract", "train_surrogate", "evaluate", "fidelity", "lm_eval"]
GENERATED = {e.config for e in CATALOG if not e.written}  # tests/test_press_catalog.py runs each against kvpress
METHODS = sorted(
    p.stem for p in (CONF_DIR / "method").glob("*.yaml") if not p.stem.startswith("_") and p.stem not in GENERATED
)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml") if not p.stem.startswith("_"))


def groups_of(stage: str) -> list[str]:
    defaults = OmegaConf.load(CONF_DIR / f"{stage}.yaml").defaults
    return [next(iter(d)) for d in defaults if isinstance(d, dict) or OmegaConf.is_dict(d)]


@pytest.mark.parametrize("stage", STAGES)
def test_every_option_of_every_group_composes_and_resolves_with_the_stage(stage: str, tmp_path: Path) -> None:
    assert options("paths") == ["default"]
    for group in groups_of(stage):
        for option in options(group):
            cfg = compose_stage(stage, None, [f"{group}={option}", f"paths.root={tmp_path}"])
            resolved = OmegaConf.to_container(cfg, resolve=True)
            name = "default" if group == "logger" else f"{group}={option}"  # the logger never names a run
            assert resolved["out_dir"] == f"{tmp_path}/{stage}/{name}", (group, option)


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("runs")
    adapter = ModelAdapter(tiny.model)
    shape = (adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads)
    for kind in ("mlp", "linear"):
        surrogate_run(root / kind, *shape, kind)
    context = {"context": ("value_norms", "position", "counts"), "q_heads": adapter.num_heads, "mlp_layers": 2}
    surrogate_run(root / "mlp_context", *shape, **context)
    found = {
        name: str(root / name.removeprefix("surrogate_"))
        for name in ("surrogate_mlp", "surrogate_linear", "surrogate_mlp_context")
    }
    return {**found, "budgets": str(budgets_run(root / "budgets", adapter.num_layers, adapter.num_kv_heads))}


@pytest.mark.parametrize("name", METHODS)
def test_every_method_config_builds_and_compresses_on_the_tiny_model(name: str, tiny, runs) -> None:
    method = build(method_config(name, paths=runs))
    described = method.describe()
    assert described["name"] == name and json.dumps(described)  # what a run records is JSON
    session = Session(ModelAdapter(tiny.model), tiny.tokenizer)
    prompt = build_prompt(tiny.tokenizer, "Maps of rivers and the people who draw them. " * 30, "What?")
    cache = method.compress(session, prompt)
    stats = cache.stats()
    assert (cache.stands_for or cache.get_seq_length()) == prompt.context_ids.shape[1]  # a summary stands for it
    assert 0.0 <= stats["prune_ratio"] < 1.0
    decode = lambda c: method.decode_context(session, c)
    tokens = session.generate(cache, prompt.question_ids, 3, decode_context=decode).tokens
    assert len(tokens) <= 3 and all(isinstance(t, int) for t in tokens)
    assert torch.isfinite(torch.tensor([stats["prune_ratio"]])).all()


def readme_sweeps() -> list[list[str]]:
    """The README's ``-m`` sweep commands, as argument lists."""
    text = (CONF_DIR.parent / "README.md").read_text()
    lines = re.findall(r"^\.venv/bin/python -m kvresearch\.stages\.\S+ -m .*$", text, re.M)
    return [shlex.split(line) for line in lines]


TINY_EVALUATE = [
    "model=tiny_random",
    "benchmark.lengths=[512]",
    "benchmark.samples_per_task=1",
    "benchmark.tasks=[niah_single_1]",
    "evaluate.max_new_tokens=4",
]


@pytest.mark.slow
def test_the_readme_sweeps_run_as_written(runs, tmp_path: Path) -> None:
    sweeps = readme_sweeps()
    assert len(sweeps) >= 3 and any("method.keep_ratio=0.5,0.25" in s for s in sweeps)
    synthetic_extract(tmp_path / "extract", lambda h: h[..., :2] * 0.5, 2, 16, 2, n_docs=10, rows=50)
    env = {**os.environ, "KVRESEARCH_OUTPUTS": str(tmp_path / "out")}
    for argv in sweeps:
        stage = argv[2].rsplit(".", 1)[1]
        extra = [f"paths.{k}={v}" for k, v in runs.items()] + TINY_EVALUATE if stage == "evaluate" else []
        extra += [f"paths.extract={tmp_path / 'extract'}", "surrogate.epochs=1"] if stage == "train_surrogate" else []
        cmd = [sys.executable, *argv[1:], *extra]
        result = subprocess.run(cmd, cwd=CONF_DIR.parent, env=env, capture_output=True, text=True, timeout=1200)
        assert result.returncode == 0, (argv, result.stderr[-3000:])
        jobs = 1
        for arg in argv[4:]:  # after "python -m kvresearch.stages.<stage> -m"
            jobs *= len(arg.split("=", 1)[1].split(","))
        assert len(list((tmp_path / "out" / stage).glob("*/DONE"))) >= jobs, argv
    keep = [json.loads(p.read_text()) for p in (tmp_path / "out" / "evaluate").glob("*keep_ratio*/metrics.json")]
    assert {(m["method"]["name"], m["method"]["keep_ratio"]) for m in keep} == {
        (m, r) for m in ("snapkv", "tova", "kvzap_mlp", "kvzip_plus", "am_omp") for r in (0.5, 0.25)
    }
