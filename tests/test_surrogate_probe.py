"""kvresearch/studies/probe.py: each richer input explains exactly the part of a planted target it carries."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from kvresearch.models import ModelAdapter
from kvresearch.ops.scores import value_output_norms
from kvresearch.runs import execute, repo_root
from kvresearch.stages.extract import run as extract_stage
from kvresearch.studies import probe as probe_script
from kvresearch.surrogate.data import ExtractRun
from tests.helpers import compose_stage, model_config, synthetic_extract


def log_norms(adapter: ModelAdapter, h: torch.Tensor, layer: int) -> torch.Tensor:
    """(rows, Hkv, G): the exact log ||v_i W_O^g|| of every query head."""
    _, _, v = adapter.project(layer, h[None])
    return value_output_norms(v[0], adapter.output_weight(layer)).permute(2, 0, 1).log()


def probe(tmp_path: Path, teacher: Callable[[torch.Tensor], torch.Tensor], adapter: ModelAdapter, *args: str) -> Any:
    """Run the probe (``args``) on a 12-document extract of ``teacher``'s targets, essays left out; its JSON."""
    folder = tmp_path / "extract"
    if not folder.exists():
        layers, hidden, kv_heads = adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads
        manifest = synthetic_extract(folder, teacher, layers, hidden, kv_heads, n_docs=12, rows=300)
        for doc in manifest["documents"]:
            doc["source"] = "essays" if doc["index"] % 3 == 0 else "wiki"  # essays: the source left out
        (folder / "manifest.json").write_text(json.dumps(manifest))
        OmegaConf.save({"model": model_config("tiny_random")}, folder / "config.yaml")
    out = tmp_path / f"probe{len(list(tmp_path.glob('probe*.json')))}.json"
    cmd = [sys.executable, "-m", "kvresearch.studies.probe", "--extract", str(folder), *args, "--out", str(out)]
    done = subprocess.run(cmd, cwd=repo_root(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def test_the_probe_credits_value_norms_neighbours_and_position_to_the_parts_they_carry(tmp_path: Path, tiny) -> None:
    adapter = ModelAdapter(tiny.model)
    layers, hidden, kv_heads = adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads
    torch.manual_seed(0)
    a = torch.randn(layers, hidden, kv_heads) / hidden**0.5
    with torch.no_grad():  # each planted part gets a unit spread, so each input's share is plain to see
        scale = [1 / log_norms(adapter, torch.randn(2000, hidden), layer)[..., 0].std() for layer in range(layers)]

    def teacher(h: torch.Tensor) -> torch.Tensor:  # (rows, layers, D) of one document, positions 0..rows-1
        out = []
        position = torch.log1p(torch.arange(len(h), dtype=torch.float32))[:, None]
        for layer in range(layers):
            prev = torch.cat([h[:1, layer], h[:-1, layer]])  # h_{i-1} (the first row its own)
            norms = log_norms(adapter, h[:, layer], layer)[..., 0]  # each KV head's first query head
            out.append(norms * scale[layer] + prev @ a[layer] + position / position.std())
        return torch.stack(out, 1)

    inputs = "h,value_norms,neighbours,position,value_norms+neighbours+position"
    result = probe(tmp_path, teacher, adapter, "--inputs", inputs)
    mean = result["mean"]
    assert result["rows"] == {"train": 8 * 300, "test": 4 * 300}
    assert abs(result["both_neighbours_share"]["test"] - 298 / 300) < 1e-6  # every position but a document's ends
    assert mean["value_norms+neighbours+position"] > 0.99  # every planted part, all inputs together
    for part in ("value_norms", "neighbours", "position"):
        assert mean["h"] + 0.2 < mean[part] < mean["value_norms+neighbours+position"] - 0.2, part

    # --alphas solves each penalty from the same statistics: alpha 1 is the run above, a huge one the mean
    by_alpha = probe(tmp_path, teacher, adapter, "--inputs", "neighbours", "--alphas", "1,1e12")["mean"]
    assert abs(by_alpha["neighbours@alpha=1"] - mean["neighbours"]) < 1e-9
    assert abs(by_alpha["neighbours@alpha=1e+12"]) < 0.01  # every weight shrunk to about 0: the training mean


def test_the_factored_mlp_fits_a_target_of_the_kvzip_plus_form_that_a_plain_mlp_cannot(tmp_path: Path, tiny) -> None:
    adapter = ModelAdapter(tiny.model)
    offsets = torch.tensor([[0.0, -1.0], [0.5, -0.5]])  # (Hkv, G): each query head's attention term, constant

    def teacher(h: torch.Tensor) -> torch.Tensor:  # log max over g of a_g ||v W_O^g||, smoothed as logsumexp
        layers = range(adapter.num_layers)
        return torch.stack([(log_norms(adapter, h[:, i], i) + offsets).logsumexp(-1) for i in layers], 1)

    recipe = ["--set", "epochs=40", "batch_size=64", "lr=1e-2", "weight_decay=0"]
    result = probe(tmp_path, teacher, adapter, "--fit", "mlp", "--inputs", "h,value_norms,factored", *recipe)
    mean = result["mean"]
    assert result["fit"] == "mlp" and result["recipe"]["epochs"] == 40 and result["recipe"]["lr"] == 5e-3 * 2
    assert len(result["r2_pooled_per_layer"]["factored"]) == adapter.num_layers
    assert mean["factored"] > 0.99, mean  # the form is exact: only the offsets are left to learn
    assert mean["h"] < mean["value_norms"] - 0.2, mean  # width D/8 = 8 cannot form a 64-wide quadratic's log
    assert mean["h"] < mean["factored"] - 0.3, mean

    bad = [sys.executable, "-m", "kvresearch.studies.probe", "--inputs", "factored"]  # ridge: refused before loading
    done = subprocess.run(bad, cwd=repo_root(), capture_output=True, text=True)
    assert done.returncode != 0 and "--fit mlp" in done.stderr
    typo = [*bad[:3], "--extract", str(tmp_path / "extract"), "--fit", "mlp", "--set", "weightdecay=0"]
    done = subprocess.run(typo, cwd=repo_root(), capture_output=True, text=True)
    assert done.returncode != 0 and "weightdecay" in done.stderr and "weight_decay" in done.stderr


def test_token_counts_equal_a_brute_force_count() -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 6, 300)  # few distinct ids: every count is exercised many times
    got = probe_script.token_counts(ids)
    want = np.zeros((len(ids), 6))
    for p, t in enumerate(ids):
        bigrams = [(ids[q - 1], ids[q]) for q in range(1, len(ids))]
        want[p, 0] = (ids == t).sum()
        want[p, 3] = (ids[:p] == t).sum()
        want[p, 5] = len(ids)
        if p:
            want[p, 1] = (ids == ids[p - 1]).sum()
            want[p, 2] = bigrams.count((ids[p - 1], t))
            want[p, 4] = bigrams[: p - 1].count((ids[p - 1], t))
    np.testing.assert_allclose(got, np.log1p(want), rtol=1e-6)
    assert probe_script.token_counts(np.zeros(0, np.int64)).shape == (0, 6)


def test_counts_come_from_the_extracts_own_documents_and_a_changed_corpus_is_refused(tmp_path: Path, tiny) -> None:
    overrides = ["model=tiny_random", "corpus.min_tokens=60", "corpus.max_tokens=120", "corpus.n_train_per_source=2",
                 "corpus.n_test_per_source=0", "extract.samples_per_doc=30"]  # fmt: skip
    execute(compose_stage("extract", tmp_path / "extract", overrides), extract_stage)
    run = ExtractRun(tmp_path / "extract")
    ids = probe_script.document_ids(run, tiny.tokenizer)
    counts = {d: probe_script.token_counts(i) for d, i in ids.items()}
    docs = run.manifest["documents"]
    assert sorted(counts) == [d["index"] for d in docs] and len(docs) == 6
    for d in docs:  # one row per token of the document, its length in the last column
        assert counts[d["index"]].shape == (d["n_tokens"], 6)
        np.testing.assert_allclose(counts[d["index"]][:, 5], np.log1p(d["n_tokens"]), rtol=1e-6)
    split = probe_script.Split(run, {d["index"] for d in docs}, ids)
    assert split.h.dtype == run.stored_dtype == torch.bfloat16  # as stored: half of float32's memory, exact
    torch.testing.assert_close(split.h.float(), run.fetch(run.rows_of({d["index"] for d in docs}))[0], rtol=0, atol=0)
    pos = np.concatenate([np.asarray(s.pos) for s in run.shards])
    row = 7  # the counts follow each row's own document and position
    np.testing.assert_array_equal(split.counts[row].numpy(), counts[int(run.doc[row])][int(pos[row])])

    # the probe runs on the real extract above (its teacher builds synthetic ones only)
    result = probe(tmp_path, lambda h: h, ModelAdapter(tiny.model), "--inputs", "h,counts,rates")
    assert set(result["mean"]) == {"h", "counts", "rates"}

    manifest = json.loads((tmp_path / "extract" / "manifest.json").read_text())
    manifest["documents"][2]["doc_id"] = "essays/train/999"
    (tmp_path / "extract" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit, match=r"does not hold the manifest's document 2 \(essays/train/999"):
        probe_script.document_ids(ExtractRun(tmp_path / "extract"), tiny.tokenizer)
