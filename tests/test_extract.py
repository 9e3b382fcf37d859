"""The extract stage end to end on the embedded model: shapes, dtypes, manifest, resume, damage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvresearch.capture import oracle_scores
from kvresearch.data.corpus import Document, cap_documents, load_corpus
from kvresearch.data.shards import hidden_from_numpy, open_shard
from kvresearch.errors import KVResearchError
from kvresearch.extraction import sample_positions
from kvresearch.models import ModelAdapter, load_model
from kvresearch.models.hooks import attention_inputs
from kvresearch.prompts import repeat_prompt
from kvresearch.runs import execute
from kvresearch.stages.extract import run, verify
from tests.helpers import compose_stage

SHORT = [
    "corpus.min_tokens=60",
    "corpus.max_tokens=120",
    "corpus.n_train_per_source=1",
    "corpus.n_test_per_source=0",
    "extract.samples_per_doc=40",
    "extract.rows_per_shard=1",
]


def test_sample_positions_are_sorted_unique_and_reproducible() -> None:
    p = sample_positions(100, 40, seed=0, doc_index=3)
    assert p.tolist() == sorted(set(p.tolist())) and len(p) == 40 and int(p.max()) < 100
    assert p.tolist() == sample_positions(100, 40, seed=0, doc_index=3).tolist()
    assert sample_positions(10, 40, seed=0, doc_index=3).tolist() == list(range(10))
    assert sample_positions(10, None, seed=0, doc_index=3).tolist() == list(range(10))


def test_the_positions_per_document_follow_the_corpus_unless_set() -> None:
    positions = lambda *o: compose_stage("extract", None, list(o)).extract.samples_per_doc
    assert positions() is None  # the packaged prose: every position of fewer documents
    assert positions("corpus=nemotron_sample") == 500  # the reference corpus: 500 of each of 4,500 documents
    assert positions("corpus=nemotron_sample", "extract.samples_per_doc=100") == 100


@pytest.mark.slow
def test_extract_end_to_end_stores_the_oracle_targets_of_the_embedded_model(tmp_path: Path) -> None:
    cfg = compose_stage("extract", tmp_path / "run", SHORT)
    metrics = execute(cfg, run)
    out = tmp_path / "run"
    manifest = json.loads((out / "manifest.json").read_text())
    assert metrics["documents_done"] == 3 and metrics["samples"] == 120 and metrics["shards"] == 3
    assert manifest["layout"] == {"layers": 30, "hidden": 576, "kv_heads": 3, "hidden_dtype": "bfloat16"}
    assert [d["status"] for d in manifest["documents"]] == ["done"] * 3
    shard = open_shard(out / "shards" / "shard-00001")
    assert shard.hidden.shape == (40, 30, 576) and shard.hidden.dtype == np.uint16
    assert shard.scores.shape == (40, 30, 3) and shard.scores.dtype == np.float32
    assert np.isfinite(shard.scores).all() and (np.diff(shard.pos) > 0).all() and set(shard.doc.tolist()) == {1}
    # The stored rows are log KVzip+ and h of that document at those positions, recomputed independently.
    loaded = load_model(cfg.model)
    adapter, tok = ModelAdapter(loaded.model), loaded.tokenizer
    doc = load_corpus(cfg.corpus, tok, cfg.seed)[0][1]
    inputs: dict[int, torch.Tensor] = {}
    prompt = repeat_prompt(tok, tok(doc.text, add_special_tokens=False).input_ids)
    with attention_inputs(adapter, inputs):
        layers = oracle_scores(adapter, prompt)
    pos = torch.from_numpy(np.array(shard.pos)).long()
    for layer in (0, 17, 29):
        np.testing.assert_allclose(shard.scores[:, layer], layers[layer].kvzip_plus[:, pos].T.log().numpy(), rtol=1e-4)
        h = hidden_from_numpy(shard.hidden[:, layer], "bfloat16").float()
        torch.testing.assert_close(h, inputs[layer][0, prompt.context.start + pos].bfloat16().float())


def test_extract_refuses_documents_longer_than_the_model(tmp_path: Path) -> None:
    cfg = compose_stage("extract", tmp_path, [*SHORT, "model=tiny_random", "model.max_context=100"])
    with pytest.raises(KVResearchError, match=r"lower corpus\.min_tokens"):
        execute(cfg, run)


def test_cap_documents_keeps_test_and_train_in_proportion_taking_sources_in_turn() -> None:
    docs = [
        Document(f"{src}/{split}/{i}", src, split, "x", 1)
        for split, n in (("test", 4), ("train", 16))
        for src in ("a", "b")
        for i in range(n // 2)
    ]
    capped = cap_documents(docs, 5)
    assert [(d.split, d.source) for d in capped] == [
        ("test", "a"),
        ("train", "a"),
        ("train", "b"),
        ("train", "a"),
        ("train", "b"),
    ]
    assert cap_documents(docs, None) == docs and cap_documents(docs, 100) == docs


TINY = [*SHORT, "model=tiny_random", "extract.max_docs=4", "corpus.n_test_per_source=1"]


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted((out / "shards").rglob("*")) if p.is_file()}


def test_re_running_a_finished_extract_repairs_missing_and_damaged_shards_identically(tmp_path: Path) -> None:
    cfg = compose_stage("extract", tmp_path / "run", TINY)
    first = execute(cfg, run)
    out = tmp_path / "run"
    assert first["documents_done"] == 4 and first["shards"] == 4
    names = sorted(p.name for p in (out / "shards").iterdir())
    assert names == [f"shard-{i:05d}" for i in range(4)]  # named by their first document
    original, manifest = shard_bytes(out), (out / "manifest.json").read_text()
    shutil.rmtree(out / "shards" / "shard-00001")  # lost
    hidden = out / "shards" / "shard-00002" / "hidden.npy"
    damaged = bytearray(hidden.read_bytes())
    damaged[-64:] = b"\xff" * 64  # same size: only the checksum tells
    hidden.write_bytes(bytes(damaged))
    with pytest.raises(KVResearchError, match=r"shard-00001 is missing|shard-00002: hidden\.npy fails its checksum"):
        verify(out)
    again = execute(cfg, run, verify)  # DONE, but damaged: repaired without force (the stage's own check)
    assert again["extracted_this_run"] == 2 and shard_bytes(out) == original
    assert (out / "manifest.json").read_text() == manifest
    verify(out)
    assert execute(cfg, run, verify)["extracted_this_run"] == 2  # intact now: skipped (its metrics returned)


def test_a_corpus_where_nothing_survives_says_why_each_document_was_left(tmp_path: Path) -> None:
    from kvresearch.extraction import write_manifest

    documents = [{"status": "skipped_long"}, {"status": "skipped_long"}, {"status": "skipped_empty"}]
    with pytest.raises(KVResearchError) as caught:
        write_manifest(tmp_path, documents, {}, "tiny_random", {}, {})
    message = str(caught.value)
    assert "Of 3 documents: 1 empty after tokenization" in message
    assert "2 too long to fit model.max_context once repeated" in message and "corpus.max_tokens" in message
