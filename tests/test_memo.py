"""The tensor memo: KVzip+'s oracle computed once per context and read back for the next budget, identically."""

from __future__ import annotations

from pathlib import Path

import torch

from kvresearch.data.memo import TensorMemo
from kvresearch.methods.kvzip import KVzip
from kvresearch.models import ModelAdapter, Session
from kvresearch.prompts import build_prompt


def kept(cache) -> list[torch.Tensor]:
    """The rotary positions each KV head keeps, layer by layer."""
    return [layer.head_positions(h).clone() for layer in cache.ragged for h in range(len(layer.lengths))]


def test_kvzip_plus_reads_its_oracle_back_from_the_memo_and_keeps_the_same_entries(tiny, tmp_path: Path) -> None:
    prompt = build_prompt(tiny.tokenizer, "Rivers carry silt to the sea and build deltas. " * 25, "Where?")
    plain = Session(ModelAdapter(tiny.model), tiny.tokenizer)
    memo = TensorMemo(tmp_path / "memo")
    shared = Session(ModelAdapter(tiny.model), tiny.tokenizer, memo)
    for keep in (0.5, 0.25):
        reference = kept(KVzip(keep_ratio=keep).compress(plain, prompt))
        ours = kept(KVzip(keep_ratio=keep).compress(shared, prompt))
        assert len(reference) == len(ours) and all(torch.equal(a, b) for a, b in zip(reference, ours, strict=True))
    assert (memo.misses, memo.hits) == (1, 1)  # the second budget read the first one's oracle
    (file,) = list((tmp_path / "memo").glob("*.safetensors"))
    file.write_bytes(file.read_bytes()[:50])  # damaged: computed again, never taken as it is
    again = kept(KVzip(keep_ratio=0.25).compress(shared, prompt))
    assert all(torch.equal(a, b) for a, b in zip(again, ours, strict=True)) and memo.misses == 2
    assert not list((tmp_path / "memo").glob(".*tmp*"))


def test_kvzap_calibrates_each_target_from_the_held_out_scores_of_the_first(tiny, tmp_path: Path) -> None:
    from kvresearch.methods.kvzap import KVzap
    from tests.helpers import surrogate_run

    adapter = ModelAdapter(tiny.model)
    surrogate = surrogate_run(tmp_path / "s", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads)
    prompts = [build_prompt(tiny.tokenizer, f"{word} " * 60, "q?") for word in ("stone", "river", "cloud")]
    plain = Session(adapter, tiny.tokenizer)
    memo = TensorMemo(tmp_path / "memo")
    shared = Session(adapter, tiny.tokenizer, memo)
    for target in (0.5, 0.75):
        expected = KVzap(
            surrogate=surrogate, calibrate=True, keep_ratio=1 - target, threshold=None, window=4
        ).fit_threshold(plain, prompts)
        assert (
            KVzap(surrogate=surrogate, calibrate=True, keep_ratio=1 - target, threshold=None, window=4).fit_threshold(
                shared, prompts
            )
            == expected
        )
    assert (memo.misses, memo.hits) == (3, 3)  # one file per held-out context, read back for the second target
    other = surrogate_run(tmp_path / "t", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads, seed=1)
    KVzap(surrogate=other, calibrate=True, keep_ratio=0.5, threshold=None, window=4).fit_threshold(shared, prompts)
    assert memo.misses == 6  # another surrogate's scores are its own
