"""RULER generated offline: needles and answers where the metric expects them, lengths, metrics, loaders."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from pathlib import Path

import pytest

from kvresearch.benchmarks import ruler
from kvresearch.benchmarks.loader import load_samples
from kvresearch.benchmarks.metrics import METRICS, string_match_all, string_match_part
from kvresearch.errors import KVResearchError
from tests.helpers import compose_stage

TABLE = ruler.Table.default()


def n_tokens(tok, sample) -> int:
    return len(tok(sample["context"] + "\n" + sample["question"], add_special_tokens=False).input_ids)


@pytest.mark.parametrize("length", [1024, 2048])
@pytest.mark.parametrize("task", TABLE.synthetic_tasks)
def test_each_task_holds_its_answers_and_fits_its_length(task, length, tiny) -> None:
    tok = tiny.tokenizer
    sample = ruler.make_sample(task, tok, length, seed=42, index=0)
    context, answers = sample["context"], sample["answer"]
    spec = TABLE.spec(task)
    kind = spec["kind"]
    if kind == "niah":
        assert len(answers) == spec["num_needle_v"] * spec["num_needle_q"]
        for value in answers:
            assert re.search(rf"One of the special magic \w+ for [\w-]+ is: {re.escape(value)}\.", context)
        assert all(q in sample["question"] for q in re.findall(r"for ([\w-]+(?:, [\w-]+)*)", sample["question"]))
    elif kind == "variable_tracking":
        value = re.search(r"assigned the value (\d+)", sample["question"]).group(1)
        assert f"VAR {answers[0]} = {value}" in context
        for prev, nxt in itertools.pairwise(answers):
            assert f"VAR {nxt} = VAR {prev}" in context
    elif kind == "common_words_extraction":
        words = Counter(re.findall(r"\d+\. (\S+)", context.split("Question:")[-1]))
        top = {w for w, _ in words.most_common(10)}
        assert set(answers) == top and len(answers) == 10
    else:  # fwe
        counts = Counter(w for w in context.split(". ", 1)[-1].split() if w != "...")
        assert answers == [w for w, _ in counts.most_common(3)]
    length_now = n_tokens(tok, sample) + TABLE.kinds[kind]["tokens_to_generate"]
    assert length_now == sample["length"] <= length
    slack = 0.03 if task == "niah_multikey_3" else 0.02  # one uuid line is ~54 tokens: 2.6% of 2k
    assert length_now >= (1 - slack) * length, (task, length_now)
    assert ruler.make_sample(task, tok, length, seed=42, index=0) == sample
    assert ruler.make_sample(task, tok, length, seed=42, index=1)["answer"] != answers


@pytest.mark.parametrize("task", TABLE.synthetic_tasks)
def test_a_known_good_prediction_scores_one_and_a_wrong_one_zero(task, tiny) -> None:
    sample = ruler.make_sample(task, tiny.tokenizer, 1024, seed=7, index=0)
    metric = METRICS[TABLE.kind(task)["metric"]]
    assert metric(" " + ", ".join(sample["answer"]) + ".", sample["answer"]) == 1.0
    assert metric("I do not know.", sample["answer"]) == 0.0


def test_metrics_follow_ruler() -> None:
    assert string_match_all("a 12 b 34", ["12", "34", "56", "78"]) == 0.5
    assert string_match_part("Paris.\x07", ["paris", "Lyon"]) == 1.0


def test_kvpress_hub_schema_loads_from_a_local_copy(tmp_path: Path, tiny) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [ruler.make_sample(t, tiny.tokenizer, 1024, 42, 0) for t in ("niah_single_1", "vt")]
    table = pa.table(
        {k: [r[k] for r in rows] for k in ("context", "question", "answer_prefix", "answer", "task", "max_new_tokens")}
    )
    pq.write_table(table, tmp_path / "1024.parquet")
    overrides = ["benchmark.source=files", f"benchmark.files.folder={tmp_path}"]
    cfg = compose_stage("evaluate", tmp_path, [*overrides, "benchmark.tasks=[vt]", "benchmark.lengths=[1024]"])
    (sample,) = load_samples(cfg.benchmark, tiny.tokenizer)
    assert (sample.task, sample.length, sample.index, sample.key) == ("vt", 1024, 0, "vt@1024#0")
    assert sample.metric == "string_match_all" and list(sample.questions[0].references) == rows[1]["answer"]


def test_the_task_table_is_data_and_bad_benchmark_configs_are_named(tmp_path: Path, tiny) -> None:
    cfg = compose_stage("evaluate", tmp_path, ["benchmark.tasks=[niah_single_1]", "benchmark.lengths=[1024]"])
    assert cfg.benchmark.definitions.niah_multikey_1.num_needle_k == 4  # conf/benchmark/ruler.yaml, not code
    cfg.benchmark.kinds.niah.needle = "The code word of {key} is {value}."  # a change there changes the samples
    (sample,) = load_samples(cfg.benchmark, tiny.tokenizer)[:1]
    assert f"The code word of {sample.questions[0].text.split(' for ')[1].split(' ')[0]} is" in sample.context
    cfg.benchmark.tasks = ["niah_single_9"]
    with pytest.raises(KVResearchError, match="Unknown RULER tasks"):
        load_samples(cfg.benchmark, tiny.tokenizer)
    cfg.benchmark.source = "ftp"
    with pytest.raises(KVResearchError, match=r"benchmark\.source must be one of"):
        load_samples(cfg.benchmark, tiny.tokenizer)
    cfg.benchmark.source = "files"
    with pytest.raises(KVResearchError, match=r"no 1024\.jsonl, \.json or \.parquet in benchmark\.files\.folder"):
        load_samples(cfg.benchmark, tiny.tokenizer)
