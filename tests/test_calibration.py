"""KVzap thresholds calibrated to a target prune ratio: the search against brute force, and held-out transfer."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from kvresearch.benchmarks.loader import calibration_samples, load_samples
from kvresearch.errors import KVResearchError
from kvresearch.models import ModelAdapter, load_model
from kvresearch.ops.calibration import calibrate_threshold, prune_ratios
from kvresearch.runs import execute
from kvresearch.stages.evaluate import run
from tests.helpers import compose_stage, surrogate_run


@pytest.mark.parametrize("target", [0.0, 0.13, 0.5, 0.77, 0.99])
def test_calibrated_threshold_is_the_best_of_every_candidate(target: float) -> None:
    g = torch.Generator().manual_seed(1)
    sizes = [(37, 50), (80, 100), (5, 9)]  # (eligible scores, entries) per context
    eligible = [torch.randn(n, generator=g).round(decimals=1) for n, _ in sizes]  # ties on purpose
    entries = [m for _, m in sizes]
    result = calibrate_threshold(eligible, entries, target)
    # Brute force in float64: every threshold that changes the mean ratio, and one beyond each end.
    values = sorted({float(v) for s in eligible for v in s})
    candidates = [values[0] - 1, *[(a + b) / 2 for a, b in itertools.pairwise(values)], values[-1] + 1]
    means = [sum(float((s < t).sum()) / m for s, m in zip(eligible, entries, strict=True)) / 3 for t in candidates]
    best = min(abs(m - target) for m in means)
    assert abs(result.achieved - target) == pytest.approx(best, abs=1e-12)
    assert result.achieved == pytest.approx(float(prune_ratios(eligible, entries, result.threshold).mean()))


def test_targets_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        calibrate_threshold([torch.zeros(3)], [3], 1.0)


@pytest.mark.slow
def test_threshold_calibrated_on_held_out_contexts_reaches_the_target_on_the_evaluated_ones(tmp_path: Path) -> None:
    """RULER at 1k on the embedded model: 4 held-out contexts set tau, 4 others are evaluated at that tau."""
    overrides = [
        f"paths.root={tmp_path}",
        "benchmark.lengths=[1024]",
        "benchmark.samples_per_task=2",
        "benchmark.tasks=[niah_single_2,niah_multikey_1]",
        "evaluate.max_new_tokens=4",
        "evaluate.fidelity=false",
        "evaluate.calibration_samples=4",
        f"paths.surrogate_linear={tmp_path / 'surrogate'}",
    ]
    loaded = load_model(compose_stage("evaluate", None, ["model=smollm2_135m"]).model)
    adapter = ModelAdapter(loaded.model)
    surrogate_run(tmp_path / "surrogate", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads,
                  kind="linear", model="smollm2_135m")  # fmt: skip
    cfg = compose_stage("evaluate", None, overrides)
    evaluated = load_samples(cfg.benchmark, loaded.tokenizer)
    held_out = calibration_samples(cfg.benchmark, loaded.tokenizer, evaluated, 4)
    assert len(held_out) == 4 and not {s.context for s in held_out} & {s.context for s in evaluated}
    assert sorted(s.task for s in held_out) == sorted(s.task for s in evaluated)  # spread over the tasks
    for target in (0.3, 0.6):
        cfg = compose_stage(
            "evaluate",
            None,
            [*overrides, "method=kvzap_linear", "method.calibrate=true", f"method.keep_ratio={1 - target}"],
        )
        metrics = execute(cfg, run)
        calibration = metrics["calibration"]
        assert calibration["contexts"] == 4 and abs(calibration["achieved"] - target) < 0.005
        assert metrics["overall"]["samples"] == 4
        assert abs(metrics["overall"]["prune_ratio"] - target) < 0.02, metrics["overall"]["prune_ratio"]
        assert metrics["method"]["threshold"] == pytest.approx(calibration["threshold"])


def test_file_benchmarks_calibrate_on_contexts_left_out_of_the_evaluation(tiny) -> None:
    cfg = compose_stage("evaluate", None, ["model=tiny_random", "benchmark=quality"]).benchmark
    samples = load_samples(cfg, tiny.tokenizer)
    held_out = calibration_samples(cfg, tiny.tokenizer, samples[:3], 5)
    assert len(held_out) == 5 and not {s.context for s in held_out} & {s.context for s in samples[:3]}
    with pytest.raises(KVResearchError, match="none is left to calibrate"):
        calibration_samples(cfg, tiny.tokenizer, samples, 2)


def test_a_method_asked_to_calibrate_refuses_to_compress_before_it_has(tiny, tmp_path: Path) -> None:
    from kvresearch.methods.kvzap import KVzap
    from kvresearch.models import Session
    from kvresearch.prompts import build_prompt

    adapter = ModelAdapter(tiny.model)
    surrogate = surrogate_run(tmp_path, adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads)
    method = KVzap(surrogate=surrogate, calibrate=True, keep_ratio=0.5, threshold=None, window=4)
    session = Session(adapter, tiny.tokenizer)
    prompt = build_prompt(tiny.tokenizer, "a b c d e f g h i j k l m n o p", "q?")
    prompt.context_ids.clamp_(max=96)  # the tiny vocabulary
    with pytest.raises(KVResearchError, match="only the evaluate stage"):
        method.compress(session, prompt)
    result = method.fit_threshold(session, [prompt])
    assert abs(result.achieved - 0.5) < 0.05 and method.compress(session, prompt).stats()["prune_ratio"] > 0.4


def test_a_calibrated_token_layer_threshold_reaches_its_ratio_with_one_decision_per_position(tiny, tmp_path) -> None:
    from kvresearch.methods.kvzap import KVzap
    from kvresearch.models import Session
    from kvresearch.prompts import build_prompt

    adapter = ModelAdapter(tiny.model)
    surrogate = surrogate_run(tmp_path, adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads)
    session = Session(adapter, tiny.tokenizer)
    prompt = build_prompt(tiny.tokenizer, " ".join("abcdefghijklmnop" * 4), "q?")
    prompt.context_ids.clamp_(max=96)  # the tiny vocabulary
    options = {"calibrate": True, "keep_ratio": 0.5, "threshold": None, "window": 4}
    shared = KVzap(surrogate=surrogate, scope="token_layer", **options)
    per_head = KVzap(surrogate=surrogate, **options)
    assert abs(shared.fit_threshold(session, [prompt]).achieved - 0.5) < 0.05
    assert shared.threshold != per_head.fit_threshold(session, [prompt]).threshold  # the position's score meets it
    cache = shared.compress(session, prompt)
    assert abs(cache.stats()["prune_ratio"] - 0.5) < 0.05
    for layer in cache.ragged:
        assert layer.head_positions(0).tolist() == layer.head_positions(1).tolist()
    with pytest.raises(KVResearchError, match="max_entries"):
        KVzap(surrogate=surrogate, scope="token_layer", threshold=-4.0, max_entries=64)
