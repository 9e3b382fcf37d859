"""The ``kvresearch`` lm-eval model: with the full cache it is lm-eval's own HF model (log-likelihoods to float32
noise, the same greedy generations); compressed, each document is compressed once; the stage and the command line
run lm-eval's evaluator on the vendored tasks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvpress import SnapKVPress
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

from kvresearch.errors import KVResearchError
from kvresearch.lmeval import KVResearchLM
from kvresearch.lmeval.model import split_ids
from kvresearch.methods.base import FullCache
from kvresearch.methods.baselines import KVPress
from kvresearch.models import ModelAdapter, Session
from kvresearch.runs import execute
from kvresearch.stages.lm_eval import run as lm_eval_run
from tests.helpers import compose_stage

DOC = " ".join(f"Station {i} lies {i * 37 % 101} miles north of the river and keeps {i % 7} boats." for i in range(14))
QUESTIONS = ["How many boats does station 3 keep?", "How far north is station 9?"]
CHOICES = [" 3 boats.", " 5 boats.", " nine miles."]


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def contexts() -> list[str]:
    return [f"{DOC}\n\nQuestion: {q}\nAnswer:" for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf(smol) -> HFLM:
    return HFLM(pretrained=smol.model, tokenizer=smol.tokenizer, batch_size=1, max_length=2048)


def ours(smol, method, **options) -> KVResearchLM:
    return KVResearchLM(Session(ModelAdapter(smol.model), smol.tokenizer), method, **options)


def test_full_cache_loglikelihoods_match_lm_evals_hf_model(smol, hf) -> None:
    args = [(c, choice) for c in contexts() for choice in CHOICES] + [("", " The river."), (DOC, " Boats.")]
    lm = ours(smol, FullCache())
    got, want = lm.loglikelihood(requests("loglikelihood", args)), hf.loglikelihood(requests("loglikelihood", args))
    # ours scores the continuation against a cached prefix, lm-eval in one forward: float32 sums of ~5 tokens
    # differ by up to ~1e-4 depending on the CPU's matmul kernels (1.1e-4 at -15.5 seen on CI), so 3e-5 relative
    for (g, g_greedy), (w, w_greedy) in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=3e-5, abs=1e-4) and g_greedy == w_greedy
    assert len({round(g, 3) for g, _ in got}) == len(args)  # the values differ: the comparison means something
    assert lm.compressions == 3  # one document for the questions, the empty context, DOC alone


def test_full_cache_rolling_and_greedy_generations_match(smol, hf) -> None:
    lm = ours(smol, FullCache(), max_length=96)  # several rolling windows
    text = [(DOC[:900],)]
    got = lm.loglikelihood_rolling(requests("loglikelihood_rolling", text))
    hf._max_length = 96
    try:
        want = hf.loglikelihood_rolling(requests("loglikelihood_rolling", text))
    finally:
        hf._max_length = 2048
    # a sum over ~230 tokens: 1e-5 relative is ~1e-5 per token (lm-eval sums float32 log-probabilities)
    assert got[0] == pytest.approx(want[0], rel=1e-5) and got[0] < -100
    lm = ours(smol, FullCache())
    gen = [(c, {"until": ["\n", "."], "max_gen_toks": 12, "do_sample": False}) for c in contexts()]
    gen.append((DOC, {"until": [], "max_gen_toks": 10}))
    assert lm.generate_until(requests("generate_until", gen)) == hf.generate_until(requests("generate_until", gen))


def test_compressed_documents_are_compressed_once_unless_query_aware(smol) -> None:
    args = [(c, choice) for c in contexts() for choice in CHOICES]
    snapkv = KVPress(name="snapkv", press=SnapKVPress(window_size=4), keep_ratio=0.3)
    full = [v for v, _ in ours(smol, FullCache()).loglikelihood(requests("loglikelihood", args))]
    agnostic = ours(smol, snapkv)
    shared = [v for v, _ in agnostic.loglikelihood(requests("loglikelihood", args))]
    aware = ours(smol, snapkv, query_aware=True)
    per_question = [v for v, _ in aware.loglikelihood(requests("loglikelihood", args))]
    assert agnostic.compressions == 1 and aware.compressions == len(QUESTIONS)
    assert shared != pytest.approx(full, abs=1e-3) and per_question != pytest.approx(shared, abs=1e-3)


def test_document_split_keeps_the_request_tokens() -> None:
    assert split_ids([5, 6, 7, 8], [5, 6, 9]) == 2
    assert split_ids([5, 6], [5, 6, 7]) == 1  # at least one context token is fed after the document
    assert split_ids([5], []) == 0


def test_documents_are_cut_once_to_fit_max_length(smol) -> None:
    lm = ours(smol, FullCache(), max_length=40)
    args = [(c, choice) for c in contexts() for choice in CHOICES]
    lm.loglikelihood(requests("loglikelihood", args))
    assert lm.compressions == 1  # cut by what the longest request needs, still shared
    tight = ours(smol, FullCache(), max_length=8)
    with pytest.raises(KVResearchError, match="max_length"):
        tight.loglikelihood(requests("loglikelihood", args))


def test_stage_writes_lm_evals_results_and_resumes_from_its_cache(tmp_path: Path) -> None:
    overrides = ["method=streaming_llm", "method.keep_ratio=0.5", "lm_eval.limit=1", "lm_eval.max_length=256"]
    overrides += ["lm_eval.tasks=[kvr_quality]", "+lm_eval.metadata.max_documents=1"]
    cfg = compose_stage("lm_eval", tmp_path / "run", overrides)
    metrics = execute(cfg, lm_eval_run)
    results = json.loads((tmp_path / "run" / "lm_eval_results.json").read_text())
    acc = results["results"]["kvr_quality"]["acc,none"]
    assert metrics["results"]["kvr_quality"]["acc,none"] == acc and acc in (0.0, 1.0)
    assert results["config"]["kvresearch_method"]["keep_ratio"] == 0.5 and metrics["documents_compressed"] == 1
    samples = (tmp_path / "run" / "samples_kvr_quality.jsonl").read_text().splitlines()
    assert len(samples) == 1 and len(json.loads(samples[0])["resps"]) == 4  # one question, four options
    assert (tmp_path / "run" / "lm_eval_cache_rank0.db").exists()


def test_command_line_registers_the_model_and_the_tasks(tmp_path: Path) -> None:
    args = "model=smollm2_135m,method=knorm,keep_ratio=0.5"
    command = [sys.executable, "-m", "kvresearch.lmeval", "run", "--model", "kvresearch", "--model_args", args]
    command += ["--tasks", "kvr_aime25", "--limit", "1", "--gen_kwargs", "max_gen_toks=4"]
    command += ["--output_path", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    written = list(tmp_path.rglob("results_*.json"))
    assert len(written) == 1
    results = json.loads(written[0].read_text())
    assert "score,none" in results["results"]["kvr_aime25"]
    assert results["config"]["kvresearch_method"]["name"] == "knorm"
