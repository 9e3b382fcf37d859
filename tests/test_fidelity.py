"""Long-generation fidelity: the stage on the tiny model, against a dense forward pass and its own records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from kvresearch.fidelity import agreement
from kvresearch.prompts import build_prompt
from kvresearch.runs import execute
from kvresearch.stages.fidelity import run
from tests.helpers import compose_stage

BASE = ["model=tiny_random", "benchmark=aime25", "fidelity.prompts=2", "fidelity.new_tokens=12"]


def fidelity(root: Path, *overrides: str) -> tuple[dict, list[dict]]:
    metrics = execute(compose_stage("fidelity", None, [*BASE, f"paths.root={root}", *overrides]), run)
    folder = root / "fidelity" / metrics["run"]["name"]
    return metrics, [json.loads(x) for x in (folder / "generations.jsonl").read_text().splitlines()]


def test_agreement_counts_the_first_divergence_and_equal_positions() -> None:
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (4, 1.0)
    assert agreement([1, 9, 3, 4], [1, 2, 3, 4]) == (1, 0.75)
    assert agreement([5, 2], [1, 2, 3, 4]) == (0, 0.25)


def test_full_cache_logppl_is_the_dense_forward_pass_and_methods_read_its_generations(tmp_path: Path, tiny) -> None:
    metrics, (first, _) = fidelity(tmp_path, "method=full")
    assert metrics["overall"]["token_agreement"] == 1.0 and metrics["overall"]["first_divergence"] == 12
    problem = json.loads((Path(__file__).parents[1] / "kvresearch/benchmarks/data/aime/aime25.jsonl").open().readline())
    template = compose_stage("fidelity", None, BASE).benchmark.question
    prompt = build_prompt(tiny.tokenizer, "", template.format(question=problem["question"]))
    ids = torch.cat([prompt.context_ids, prompt.question_ids, torch.tensor([first["tokens"]])], dim=1)
    with torch.no_grad():
        logits = tiny.model(input_ids=ids).logits[0, prompt.n_tokens - 1 : -1].double()
    dense = -torch.log_softmax(logits, -1).gather(1, torch.tensor(first["tokens"])[:, None]).mean()
    assert abs(first["full_logppl"] - float(dense)) < 1e-4  # teacher forcing one token at a time = one pass
    decoding = "method.decoding={interval: 2, target_size: 40}"
    metrics, records = fidelity(tmp_path, "method=streaming_llm", "method.keep_ratio=null", decoding)
    assert "method=full" in metrics["reference_run"] and "fidelity.new_tokens=12" in metrics["reference_run"]
    for record in records:
        reference = first["tokens"] if record["id"] == first["id"] else None
        if reference is not None:
            assert (record["first_divergence"], record["token_agreement"]) == agreement(record["tokens"], reference)
        assert record["prune_ratio"] > 0.4 and record["context_prune_ratio"] == 0.0  # pruned while decoding only
        # kvpress's DecodingPress cuts a question of target_size tokens or more at once (the question is a step):
        # the cache never grows past what that first cut left, plus the tokens of one interval
        assert record["kv_bytes_final_kept"] <= record["kv_bytes_peak_kept"]
    result = subprocess.run(
        [sys.executable, "-m", "kvresearch.reports.tables", "--root", str(tmp_path), "--out", str(tmp_path / "t")],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "t" / "fidelity_table.md").read_text()
    assert "| full | - | 2 x 12 | 0.00 | 1.00 | 12 |" in table
    assert "| streaming_llm | -, decoding={interval: 2, target_size: 40} | 2 x 12 |" in table
    assert (tmp_path / "t" / "fidelity_curve.png").stat().st_size > 1000
