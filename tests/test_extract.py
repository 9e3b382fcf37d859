"""The extract stage end to end on the embedded model: shapes, dtypes, manifest, resume, damage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvresearch.capture import oracle_scores, repeat_prompt
from kvresearch.data.shards import hidden_from_numpy, open_shard
from kvresearch.errors import KVResearchError
from kvresearch.models import ModelAdapter, load_model
from kvresearch.models.hooks import attention_inputs
from kvresearch.runs import execute
from kvresearch.stages.extract import load_documents, run, sample_positions
from tests.conftest import compose_stage

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


@pytest.mark.slow
def test_extract_end_to_end_resumes_and_detects_damage(tmp_path: Path) -> None:
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
    doc = load_documents(cfg, tok)[0][1]
    inputs: dict[int, torch.Tensor] = {}
    prompt = repeat_prompt(tok, tok(doc.text, add_special_tokens=False).input_ids)
    with attention_inputs(adapter, inputs):
        layers = oracle_scores(adapter, prompt)
    pos = torch.from_numpy(np.array(shard.pos)).long()
    for layer in (0, 17, 29):
        np.testing.assert_allclose(shard.scores[:, layer], layers[layer].kvzip_plus[:, pos].T.log().numpy(), rtol=1e-4)
        h = hidden_from_numpy(shard.hidden[:, layer], "bfloat16").float()
        torch.testing.assert_close(h, inputs[layer][0, prompt.context.start + pos].bfloat16().float())
    before = np.array(shard.scores)

    # Resume: lose the last shard and DONE; only that document is redone, identically.
    shutil.rmtree(out / "shards" / "shard-00001")
    (out / "DONE").unlink()
    again = execute(cfg, run)
    assert again["extracted_this_run"] == 1 and again["samples"] == 120
    np.testing.assert_allclose(open_shard(out / "shards" / "shard-00003").scores, before, rtol=1e-5)

    # A damaged shard stops the run with its path.
    (out / "DONE").unlink()
    hidden = out / "shards" / "shard-00000" / "hidden.npy"
    hidden.write_bytes(hidden.read_bytes()[:100])
    with pytest.raises(KVResearchError, match="shard-00000"):
        execute(cfg, run)


def test_extract_refuses_documents_longer_than_the_model(tmp_path: Path) -> None:
    cfg = compose_stage("extract", tmp_path, [*SHORT, "model=tiny_random", "model.max_context=100"])
    with pytest.raises(KVResearchError, match=r"lower corpus\.min_tokens"):
        execute(cfg, run)
