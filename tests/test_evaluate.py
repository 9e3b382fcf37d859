"""The evaluate stage on the tiny model: predictions, resume, full-cache references by path, tables, bad inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvresearch.errors import KVResearchError
from kvresearch.models import ModelAdapter
from kvresearch.runs import CONF_DIR, execute
from kvresearch.stages.evaluate import run
from tests.helpers import SMALL_RULER, compose_stage, surrogate_run

SMALL = SMALL_RULER


def evaluate(root: Path, *overrides: str, base: tuple[str, ...] = tuple(SMALL)) -> dict:
    """One evaluate run under ``root`` (its folder named from the overrides, as Hydra names it)."""
    return execute(compose_stage("evaluate", None, [*base, f"paths.root={root}", *overrides]), run)


def lines(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "predictions.jsonl").read_text().splitlines()]


def test_full_cache_writes_predictions_and_resumes_keeping_every_valid_line(tmp_path: Path, capsys) -> None:
    metrics = evaluate(tmp_path, "method=full")
    folder = tmp_path / "evaluate" / metrics["run"]["name"]
    mean = sum(r["score"] for r in lines(folder)) / 2  # the bar ends on the running means over every answer
    assert f"[evaluate full] 2/2 mean_score={mean:.3f} mean_prune=0.000" in capsys.readouterr().out
    assert set(metrics["tasks"]) == {"niah_single_1@1024", "fwe@1024"}
    assert metrics["overall"]["prune_ratio"] == 0.0 and metrics["overall"]["agreement"] == 1.0
    assert metrics["full_answers_from"] == {"self": 2} and metrics["method"]["class"] == "FullCache"
    first, second = lines(folder)
    assert first["id"] == "niah_single_1@1024#0" and first["group"] == "niah_single_1@1024"
    # Damage: a junk first line, the valid second line, a torn copy of the first record.
    (folder / "predictions.jsonl").write_text("{}\n" + json.dumps(second) + "\n" + json.dumps(first)[:30])
    (folder / "DONE").unlink()
    again = evaluate(tmp_path, "method=full")
    kept = lines(folder)
    assert [r["id"] for r in kept] == ["fwe@1024#0", "niah_single_1@1024#0"]  # valid line kept, the lost one redone
    assert kept[1]["prediction"] == first["prediction"] and again["overall"]["samples"] == 2


def test_kvzap_takes_full_answers_from_the_sibling_full_run_and_tables_read_the_runs(tmp_path: Path, tiny) -> None:
    adapter = ModelAdapter(tiny.model)
    surrogate_run(
        tmp_path / "train_surrogate" / "planted", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads
    )
    kvzap = [
        "method=kvzap_mlp",
        "paths.surrogate_mlp=train_surrogate/planted",
        "method.threshold=0.0",
        "method.window=16",
    ]
    alone = evaluate(tmp_path / "alone", *kvzap, "paths.surrogate_mlp=" + str(tmp_path / "train_surrogate/planted"))
    assert alone["full_answers_from"] == {"computed": 2} and alone["reference_run"] == ""
    full = evaluate(tmp_path, "method=full")
    metrics = evaluate(tmp_path, *kvzap)
    assert metrics["reference_run"] == str(tmp_path / "evaluate" / full["run"]["name"])
    assert metrics["full_answers_from"] == {"reference_run": 2}
    assert metrics["method"]["name"] == "kvzap_mlp" and metrics["method"]["budget"] == "tau=0"
    assert metrics["method"]["surrogate"]["run"] == str(tmp_path / "train_surrogate" / "planted")
    assert 0.0 < metrics["overall"]["prune_ratio"] < 1.0
    for key in ("agreement", "full_answer_nll", "prune_ratio", "score"):  # same numbers whatever the source
        assert metrics["overall"][key] == pytest.approx(alone["overall"][key], rel=1e-9), key
    result = subprocess.run(
        [sys.executable, "-m", "kvresearch.reports.tables", "--root", str(tmp_path), "--out", str(tmp_path / "t")],
        cwd=CONF_DIR.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "t" / "ruler_table.md").read_text()
    assert "| full | - | 2 | 0.00 |" in text and "| kvzap_mlp | tau=0, window=16 | 2 |" in text  # options shown
    assert "| mean | 95% CI | agreement |" in text
    assert (tmp_path / "t" / "ruler_curve.png").stat().st_size > 1000


def test_a_reference_run_made_under_other_settings_is_refused(tmp_path: Path) -> None:
    full = evaluate(tmp_path, "method=full", "benchmark.seed=7")
    with pytest.raises(KVResearchError, match=r"other settings \(benchmark\.seed: 7 there, 42 here\)"):
        evaluate(tmp_path, "method=snapkv", f"evaluate.reference_run={full['run']['id']}")


def test_attention_matching_reports_errors_and_step_times(tmp_path: Path) -> None:
    metrics = evaluate(
        tmp_path,
        "method=am_omp_fast",
        "method.keep_ratio=0.25",
        "method.queries.max_per_head=256",
        "method.budgets.span=all",
        "method.keys.drop_below=null",
    )
    assert metrics["method"]["name"] == "am_omp_fast" and abs(metrics["overall"]["prune_ratio"] - 0.75) < 0.02
    record = lines(tmp_path / "evaluate" / metrics["run"]["name"])[0]
    report = record["method_report"]
    assert set(report["timings_s"]) == {"queries_s", "block_s", "keys_s", "beta_s", "values_s"}
    assert 0.0 <= report["heldout_mass_rel"] < 1.0 and 0.0 <= report["heldout_output_rel_l2"] < 1.0


def test_a_context_longer_than_the_model_is_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(KVResearchError, match=r"would not fit the budget of 512 positions .*niah_single_1@1024#0"):
        evaluate(tmp_path, "method=full", "model.max_context=512")
    assert not list((tmp_path / "evaluate").glob("*/predictions.jsonl"))


def test_force_starts_over_and_damaged_metrics_beside_done_are_rebuilt(tmp_path: Path, capsys) -> None:
    metrics = evaluate(tmp_path, "method=streaming_llm", "method.keep_ratio=0.5")
    folder = tmp_path / "evaluate" / metrics["run"]["name"]
    (folder / "metrics.json").write_text('{"overall": {"sco')  # half-written, beside DONE
    again = evaluate(tmp_path, "method=streaming_llm", "method.keep_ratio=0.5")
    out = capsys.readouterr().out
    assert f"{folder / 'metrics.json'} is not valid JSON" in out and "Running the stage again" in out
    assert again["overall"] == metrics["overall"] and len(lines(folder)) == 2  # resumed: nothing redone twice
    (folder / "predictions.jsonl").write_text("")
    forced = evaluate(tmp_path, "method=streaming_llm", "method.keep_ratio=0.5", "force=true")
    assert forced["overall"]["samples"] == 2 and len(lines(folder)) == 2


TINY = ("model=tiny_random",)
QUALITY = [
    "benchmark=quality",
    "benchmark.max_documents=1",
    "benchmark.truncate=middle",
    "benchmark.max_prompt_tokens=512",
]


def test_a_document_with_many_questions_is_compressed_once_and_truncated_to_the_budget(tmp_path: Path) -> None:
    metrics = evaluate(
        tmp_path, "method=snapkv", *QUALITY, "evaluate.max_new_tokens=4", "evaluate.fidelity=false", base=TINY
    )
    records = lines(tmp_path / "evaluate" / metrics["run"]["name"])
    assert len(records) == 16 and [r["id"] for r in records[:2]] == ["quality#0/0", "quality#0/1"]
    assert len({r["compress_s"] for r in records}) == 1  # one compression, every question from its own copy
    assert len({r["prune_ratio"] for r in records}) == 1 and max(r["prompt_tokens"] for r in records) + 4 <= 512
    assert metrics["overall"]["samples"] == 16 and metrics["tasks"]["quality"]["samples"] == 16


def test_choices_scored_by_loglikelihood_equal_a_dense_forward_pass(tmp_path: Path, tiny) -> None:
    import torch

    from kvresearch.answering import Settings, prompts_of
    from kvresearch.benchmarks.loader import load_samples

    metrics = evaluate(tmp_path, "method=full", *QUALITY, "evaluate.choices=loglikelihood", base=TINY)
    record = lines(tmp_path / "evaluate" / metrics["run"]["name"])[0]
    assert record["prediction"] in "ABCD" and len(record["option_logprobs"]) == 4 and "acc_norm" in metrics["overall"]
    assert record["prediction"] == "ABCD"[max(range(4), key=record["option_logprobs"].__getitem__)]
    cfg = compose_stage("evaluate", tmp_path / "x", [*TINY, *QUALITY])
    sample = load_samples(cfg.benchmark, tiny.tokenizer)[0]
    prompt = prompts_of(tiny.tokenizer, sample, Settings.from_config(cfg.evaluate, cfg.model, cfg.benchmark))[0]
    for option, ours in zip(sample.questions[0].choices, record["option_logprobs"], strict=True):
        target = tiny.tokenizer(" " + option, add_special_tokens=False).input_ids
        ids = torch.cat([prompt.context_ids, prompt.question_ids, torch.tensor([target])], dim=1)
        with torch.no_grad():
            logprobs = torch.log_softmax(tiny.model(ids).logits[0].double(), -1)
        start = ids.shape[1] - len(target)
        dense = sum(float(logprobs[start - 1 + i, t]) for i, t in enumerate(target))
        assert ours == pytest.approx(dense, abs=1e-3)


def test_longbench_v2_chain_of_thought_is_answered_in_a_second_step_without_the_document(tmp_path: Path) -> None:
    overrides = [
        "benchmark=longbench_v2",
        "benchmark.prompt=0shot_cot",
        "benchmark.samples_per_task=1",
        "benchmark.max_prompt_tokens=512",
        "evaluate.max_new_tokens=6",
    ]
    metrics = evaluate(tmp_path, "method=streaming_llm", *overrides, base=TINY)
    (record,) = lines(tmp_path / "evaluate" / metrics["run"]["name"])
    assert record["new_tokens"] <= 6 and "chain_of_thought" in record  # the compressed cache produced the CoT
    assert record["score"] == float(record["prediction"].count("The correct answer is") > 0 and record["score"])
    assert set(metrics["by_tag"]) == {"difficulty", "length", "domain"}


def test_sampled_answers_give_pass_at_1_over_n_reproducibly(tmp_path: Path) -> None:
    aime = [
        "model=tiny_random",
        "benchmark=aime25",
        "benchmark.max_problems=2",
        "evaluate.max_new_tokens=6",
        "evaluate.sampling={temperature: 1.0, top_k: 50, top_p: 0.9, seed: 1, n: 3}",
    ]
    metrics = evaluate(tmp_path, "method=full", base=tuple(aime))
    folder = tmp_path / "evaluate" / metrics["run"]["name"]
    records = lines(folder)
    assert [r["id"] for r in records] == ["aime25#0", "aime25#1"]
    for r in records:
        assert len(r["samples"]) == 3 and r["score"] == sum(s["score"] for s in r["samples"]) / 3
        assert r["prediction"] == r["samples"][0]["prediction"] and "agrees_with_full" not in r  # no greedy fidelity
        assert r["stop_reason"] in ("eos", "length") and r["kv_bytes_peak_kept"] >= r["kv_bytes_start_kept"] > 0
    assert len({s["prediction"] for s in records[0]["samples"]}) > 1  # three different draws
    again = evaluate(tmp_path / "again", "method=full", base=tuple(aime))
    untimed = lambda rs: [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rs]
    assert untimed(lines(tmp_path / "again" / "evaluate" / again["run"]["name"])) == untimed(records)  # seeded
