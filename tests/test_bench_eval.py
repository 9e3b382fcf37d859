"""The evaluation bench's three sides answer alike: the evaluate stage, kvpress's pipeline, transformers alone.

No timing is asserted (the bench measures; this checks that what it compares is the same computation).
"""

from __future__ import annotations

import pytest

from kvresearch.answering import Settings, prompts_of, respond
from kvresearch.bench.eval import markdown
from kvresearch.benchmarks.loader import load_samples
from kvresearch.evaluation import full_answer_nll
from kvresearch.methods.base import FullCache
from kvresearch.models import ModelAdapter, Session
from kvresearch.runs import build
from kvresearch.speed import KVpressPipeline, compare, floor, ours
from tests.helpers import SMALL_RULER, compose_stage


def test_ours_kvpress_and_transformers_give_the_same_answers(tiny) -> None:
    session = Session(ModelAdapter(tiny.model), tiny.tokenizer)
    cfg = compose_stage("evaluate", None, [*SMALL_RULER, "method=streaming_llm", "method.keep_ratio=0.5"])
    (sample,) = load_samples(cfg.benchmark, tiny.tokenizer)[:1]
    settings = Settings(fidelity=False, max_new_tokens=8)
    prompt = prompts_of(tiny.tokenizer, sample, settings)[0]
    pipeline = KVpressPipeline(session)
    for method, press in ((FullCache(), None), (build(cfg.method), build(cfg.method).press)):
        mine = ours(session, method, sample, settings)
        theirs = pipeline.answer(prompt.context_ids, prompt.question_ids, press, 8)
        assert mine["prediction"] == theirs["prediction"] and mine["new_tokens"] == 8, method.name
        assert 0 < theirs["decode_s"] < theirs["wall_s"] and mine["prefill_s"] > 0
        runs = {"ours": [mine], "kvpress": [theirs]}
        if press is None:
            runs["floor"] = [floor(session, prompt.context_ids, prompt.question_ids, 8)]
        row = compare(method.name, 1024, runs, {})
        assert row["identical_predictions"] == 1 and row.get("identical_to_floor", 1) == 1
        assert ("prefill_vs_floor" in row) == (press is None) and row.get("prefill_vs_floor", 1.0) > 0
        assert abs(row["prune_ratio"] - (0.0 if press is None else 0.5)) < 0.01
        assert f"| {method.name} | 1,024 |" in markdown({"rows": [row]}) and "| 1 of 1 |" in markdown({"rows": [row]})


def test_the_fidelity_nll_of_an_agreeing_answer_is_the_generations_own(tiny) -> None:
    """The cheap path (the generation's own log-probabilities) equals the teacher-forced pass it replaces."""
    session = Session(ModelAdapter(tiny.model), tiny.tokenizer)
    cfg = compose_stage("evaluate", None, SMALL_RULER)
    (sample,) = load_samples(cfg.benchmark, tiny.tokenizer)[:1]
    settings = Settings(fidelity=True, max_new_tokens=8)
    prompt = prompts_of(tiny.tokenizer, sample, settings)[0]
    method = FullCache()
    cache = method.compress(session, prompt)
    answer = respond(session, cache, prompt, sample.questions[0], settings)
    assert answer.logprobs is not None and len(answer.logprobs) == len(answer.tokens) == 8
    forced = session.answer_nll(cache, prompt.question_ids, answer.tokens)
    assert full_answer_nll(session, method, cache, prompt, answer, answer.tokens) == pytest.approx(forced, rel=1e-4)
    other = [*answer.tokens[:-1], answer.tokens[-1] + 1]  # a different full answer: the forced pass, as before
    assert full_answer_nll(session, method, cache, prompt, answer, other) == session.answer_nll(
        cache, prompt.question_ids, other
    )
