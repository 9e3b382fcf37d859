"""Corpora (offline English, Nemotron schema on a fixture) and the shard format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvresearch.data.corpus import benchmark_prose, nemotron_sample, offline_english, select, split_of
from kvresearch.data.shards import (
    ShardWriter,
    check_shard,
    finished_shards,
    hidden_from_numpy,
    hidden_to_numpy,
    open_shard,
)
from kvresearch.errors import KVResearchError


@pytest.fixture(scope="module")
def english(tiny):
    return offline_english(tiny.tokenizer)


def test_offline_english_documents_respect_bounds_and_split_by_source(english, tiny) -> None:
    docs, stats = english
    assert len(docs) > 2000 and {d.source for d in docs} == {"essays", "wiki", "bible"}
    assert all(750 <= d.n_tokens <= 1250 for d in docs)
    for d in docs[::97]:  # the recorded length is the real one, give or take joining spaces
        assert abs(len(tiny.tokenizer(d.text, add_special_tokens=False).input_ids) - d.n_tokens) <= 3
    train = {o for d in docs if d.split == "train" for o in d.origins}
    test = {o for d in docs if d.split == "test" for o in d.origins}
    assert train and test and not train & test
    assert 0.05 < sum(d.split == "test" for d in docs) / len(docs) < 0.2
    assert len({d.doc_id for d in docs}) == len(docs)
    assert sum(stats.kept.values()) == len(docs)


def test_offline_english_is_deterministic(english, tiny) -> None:
    again, _ = offline_english(tiny.tokenizer)
    assert [d.doc_id for d in again] == [d.doc_id for d in english[0]]
    assert again[500].text == english[0][500].text


def test_benchmark_prose_is_test_only_and_shares_nothing_with_the_training_prose(english, tiny) -> None:
    docs, stats = benchmark_prose(tiny.tokenizer)
    assert {d.source for d in docs} == {"news", "science", "fiction"} and {d.split for d in docs} == {"test"}
    assert all(750 <= d.n_tokens <= 1250 for d in docs) and sum(stats.kept.values()) == len(docs)
    assert all(o.startswith(d.source + "-") for d in docs for o in d.origins)
    assert not any("NEWLINE_CHAR" in d.text or d.text.startswith("Passage ") for d in docs)
    training = {d.text[:200] for d in english[0]}
    assert not any(d.text[:200] in training for d in docs)
    assert [d.text for d in benchmark_prose(tiny.tokenizer)[0][::50]] == [d.text for d in docs[::50]]


def test_select_is_balanced_and_seeded(english) -> None:
    picked = select(english[0], 4, 2, seed=1)
    assert len(picked) == 3 * 6
    assert select(english[0], 4, 2, seed=1) == picked != select(english[0], 4, 2, seed=2)
    assert split_of("essay-03", 0.1) == split_of("essay-03", 0.1)
    every = select(english[0], None, None, seed=1)  # no caps: every document, the capped ones first in each pool
    assert sorted(d.doc_id for d in every) == sorted(d.doc_id for d in english[0])
    assert [d for d in every if d.split == "test"][:2] == [d for d in picked if d.split == "test"][:2]


def test_nemotron_loader_on_a_fixture_in_its_schema(tmp_path: Path, tiny) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = "The model reads a long pretraining document about mathematics and code. "
    for subset, texts in {
        "Nemotron-CC-MATH": [words * 12, "", words * 40, words * 2],
        "Nemotron-SFT-Code": [words * 13] * 3,
    }.items():
        (tmp_path / subset).mkdir()
        table = pa.table(
            {"id": [f"{subset}-{i}" for i in range(len(texts))], "text": texts, "metadata": ["{}"] * len(texts)}
        )
        pq.write_table(table, tmp_path / subset / "part-0.parquet")
    docs, stats = nemotron_sample(
        tiny.tokenizer,
        100,
        250,
        n_train_per_subset=5,
        n_test_per_subset=1,
        subsets=["Nemotron-CC-MATH", "Nemotron-SFT-Code"],
        data_dir=str(tmp_path),
    )
    assert (stats.skipped_empty, stats.skipped_long, stats.skipped_short) == (1, 1, 1)
    assert [(d.doc_id, d.split) for d in docs] == [
        ("Nemotron-CC-MATH-0", "test"),
        ("Nemotron-SFT-Code-0", "test"),
        ("Nemotron-SFT-Code-1", "train"),
        ("Nemotron-SFT-Code-2", "train"),
    ]


def test_nemotron_without_hub_is_a_clear_error(tiny, tmp_path: Path) -> None:
    with pytest.raises(KVResearchError, match=r"corpus.data_dir|No \*.parquet"):
        nemotron_sample(tiny.tokenizer, subsets=["Nemotron-SFT-Code"], data_dir=str(tmp_path))


def write_docs(root: Path, n_docs: int, rows_per_shard: int) -> ShardWriter:
    writer = ShardWriter(root, "bfloat16", rows_per_shard)
    g = torch.Generator().manual_seed(0)
    for i in range(n_docs):
        writer.add(i, torch.arange(5) * (i + 1), torch.randn(5, 3, 8, generator=g), torch.randn(5, 3, 2, generator=g))
    writer.flush()
    return writer


def test_shards_round_trip_and_hold_whole_documents(tmp_path: Path) -> None:
    write_docs(tmp_path, 5, rows_per_shard=8)
    metas = finished_shards(tmp_path, full=True)
    assert [m["documents"] for m in metas] == [[0, 1], [2, 3], [4]]
    assert [m["name"] for m in metas] == ["shard-00000", "shard-00002", "shard-00004"]  # named by first document
    shard = open_shard(tmp_path / "shard-00002", full=True)
    assert isinstance(shard.hidden, np.memmap) and shard.hidden.shape == (10, 3, 8)
    assert shard.scores.dtype == np.float32 and shard.scores.shape == (10, 3, 2)
    assert shard.doc.tolist() == [2] * 5 + [3] * 5 and shard.pos[:5].tolist() == [0, 3, 6, 9, 12]
    h = hidden_from_numpy(shard.hidden[:2], "bfloat16")
    assert h.dtype == torch.bfloat16 and torch.isfinite(h.float()).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_stored_hidden_states_come_back_rounded_to_their_dtype_only(dtype: str) -> None:
    h = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(0))
    back = hidden_from_numpy(hidden_to_numpy(h, dtype), dtype)
    assert back.dtype == getattr(torch, dtype) and torch.equal(back.float(), h.to(back.dtype).float())
    assert torch.equal(back.float(), h) == (dtype == "float32")  # fp32 keeps every bit


def test_damaged_shards_are_detected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_docs(tmp_path, 3, rows_per_shard=5)
    (tmp_path / ".tmp-shard-00009-123").mkdir()  # a killed writer's leftovers are cleaned up
    finished_shards(tmp_path)
    assert not list(tmp_path.glob(".tmp-*"))
    hidden = tmp_path / "shard-00001" / "hidden.npy"
    hidden.write_bytes(hidden.read_bytes()[:-10])
    with pytest.raises(KVResearchError, match=r"shard-00001: hidden.npy has .* bytes.*Re-run extract"):
        finished_shards(tmp_path)
    assert [m["name"] for m in finished_shards(tmp_path, repair=True)] == ["shard-00000", "shard-00002"]
    said = capsys.readouterr().out
    assert "removing a damaged shard, its documents are redone: Shard" in said and "it was cut short" in said
    assert not (tmp_path / "shard-00001").exists()  # removed, so that its documents are redone
    (tmp_path / "shard-00002" / "shard.json").unlink()
    with pytest.raises(KVResearchError, match=r"shard-00002 has no shard\.json"):
        check_shard(tmp_path / "shard-00002")
    meta = json.loads((tmp_path / "shard-00000" / "shard.json").read_text())
    scores = tmp_path / "shard-00000" / "scores.npy"
    data = bytearray(scores.read_bytes())
    data[-1] ^= 0xFF
    scores.write_bytes(bytes(data))
    assert meta["files"]["scores.npy"]["bytes"] == len(data)
    with pytest.raises(KVResearchError, match="checksum"):
        check_shard(tmp_path / "shard-00000", full=True)
