"""Every kvpress press: listed once, its YAML as the catalog writes it, and each bridged press against kvpress
itself item by item (the same pairs kept in every head, bit for bit, and the same greedy answer)."""

from __future__ import annotations

from pathlib import Path

import kvpress
import pytest
import torch
from hydra import compose, initialize_config_dir

from kvresearch.bench.press_check import compare, kvpress_kept, placeholder_files
from kvresearch.device_steps import random_surrogates
from kvresearch.errors import KVResearchError
from kvresearch.methods.baselines import KVPress, kvzap_press
from kvresearch.models import ModelAdapter, Session
from kvresearch.models.press_catalog import CATALOG, NOT_BRIDGED, by_class, yaml_text
from kvresearch.prompts import build_prompt
from kvresearch.runs import CONF_DIR, build
from kvresearch.speed import KVpressPipeline

NEW_TOKENS = 12


def test_every_kvpress_press_is_listed_once() -> None:
    exported = {n for n in kvpress.__all__ if n.endswith("Press")}
    assert len(exported) == 46
    assert set(by_class()) | set(NOT_BRIDGED) == exported
    assert not set(by_class()) & set(NOT_BRIDGED)
    assert len({e.cls for e in CATALOG}) == len(CATALOG) == 43


@pytest.mark.parametrize("entry", CATALOG, ids=lambda e: e.cls)
def test_yaml_is_the_catalog_entry(entry) -> None:
    path = Path(CONF_DIR) / "method" / f"{entry.config}.yaml"
    assert path.exists(), "run python -m kvresearch.models.press_catalog --write"
    if not entry.written:
        assert path.read_text() == yaml_text(entry)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", [f"method={entry.config}"])
    target = str(cfg.method.press._target_)
    if entry.config != "kvpress_kvzap":  # that one builds DMSPress(KVzapPress) from a surrogate run
        built = getattr(__import__(target.rsplit(".", 1)[0], fromlist=["x"]), target.rsplit(".", 1)[1])
        assert issubclass(built, getattr(kvpress, entry.cls))


@pytest.fixture(scope="module")
def bench(smol, tmp_path_factory):
    session = Session(ModelAdapter(smol.model), smol.tokenizer)
    text = " ".join(f"Record {i}: the key of room {i * 37 % 101} is {i * 53 % 97}." for i in range(16))
    prompt = build_prompt(smol.tokenizer, text, "What is the key of room 74?")
    files = placeholder_files(smol.model, tmp_path_factory.mktemp("press-files"))
    return session, prompt, files, KVpressPipeline(session)


def method_of(entry, session, files) -> KVPress:
    """The entry's method as its YAML builds it (placeholder files; a seeded surrogate for kvpress_kvzap)."""
    if entry.config == "kvpress_kvzap":
        return KVPress(name=entry.config, press=kvzap_press(random_surrogates(session)["mlp"], -3.0, window=16))
    overrides = [f"method.press.{entry.needs}={files[entry.needs]}"] if entry.needs else []
    overrides += {
        "DuoAttentionPress": ["method.press.samples=1", "method.press.chars=2000"],
        "ExpectedAttentionStatsPress": ["method.press.num_samples=1"],
        "DecodingPress": ["method.press.compression_interval=4", "method.press.target_size=40"],
        "PrefillDecodingPress": ["method.press.decoding_press.compression_interval=4"],
        "CompressionRatioDecodingPress": ["method.press.compression_interval=4"],
    }.get(entry.cls, [])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", [f"method={entry.config}", *overrides])
    return build(cfg.method)


@pytest.mark.parametrize("entry", CATALOG, ids=lambda e: e.cls)
def test_press_evicts_and_answers_as_kvpress(bench, entry) -> None:
    session, prompt, files, pipeline = bench
    make = lambda: method_of(entry, session, files)
    found = compare(session, pipeline, make, entry.pipeline, prompt, NEW_TOKENS)
    assert found["heads_same"] == found["heads"], f"{found['heads'] - found['heads_same']} heads keep other pairs"
    assert found["answer"] == found["kvpress_answer"]
    assert found["ours_kept_bytes"] < 1.03 * found["kvpress_kept_bytes"]  # + 12 bytes per pair: position and bias


def test_masking_press_frees_what_kvpress_holds(bench) -> None:
    session, prompt, files, _ = bench
    method = method_of(by_class()["AdaKVPress"], session, files)
    cache = method.compress(session, prompt)
    press = method_of(by_class()["AdaKVPress"], session, files).press
    _, held, _ = kvpress_kept(session, prompt.context_ids, press, None)
    n = prompt.context_ids.shape[1]
    assert cache.stats()["prune_ratio"] == pytest.approx(1 - 0.33, abs=2 / n)
    assert cache.kv_bytes()["allocated"] < 0.5 * held["kept_bytes"]  # kvpress keeps every masked pair
    assert method.report()["peak_kv_bytes"] < held["peak_bytes"]  # one dense layer at a time, not all


@pytest.mark.parametrize("cls", ["KVzipPress", "KVComposePress", "FinchPress"])
def test_a_press_that_cuts_after_the_prefill_holds_no_copies(bench, cls) -> None:
    session, prompt, files, _ = bench
    method = method_of(by_class()[cls], session, files)
    method.compress(session, prompt)
    _, held, _ = kvpress_kept(session, prompt.context_ids, method_of(by_class()[cls], session, files).press, None)
    # a copy of every layer's pairs until the end would add kvpress's whole dense cache; a hash adds 16 bytes a pair
    assert method.report()["peak_kv_bytes"] < 1.1 * held["peak_bytes"]


def test_rerotated_keys_continue_at_the_kept_length(bench) -> None:
    session, prompt, files, _ = bench
    cache = method_of(by_class()["KeyRerotationPress"], session, files).compress(session, prompt)
    kept = [int(layer.kept_per_head()[0]) for layer in cache.ragged]
    assert cache.get_seq_length() == kept[0] < prompt.context_ids.shape[1] == cache.stands_for
    assert all(
        torch.equal(layer.pos[layer.head_rows(0)], torch.arange(k)) for layer, k in zip(cache.ragged, kept, strict=True)
    )


def test_a_press_that_needs_a_file_says_which(bench) -> None:
    session, prompt, _, _ = bench
    for cls in ("QFilterPress", "FastKVzipPress", "LUKVPress", "RestoreKVPress"):
        entry = by_class()[cls]
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            method = build(compose("evaluate", [f"method={entry.config}"]).method)
        with pytest.raises(KVResearchError, match=entry.needs):
            method.compress(session, prompt)


def test_a_press_that_keeps_its_extra_passes_is_refused(bench) -> None:
    session, prompt, _, _ = bench
    press = kvpress.KVComposePress(compression_ratio=0.5, structured=False)
    with pytest.raises(KVResearchError, match="structured=true"):
        KVPress(name="kvcompose", press=press, attn_implementation="eager").compress(session, prompt)


@pytest.mark.parametrize("wrapper", [None, "AdaKVPress"])
def test_sinks_keep_the_first_positions_and_the_scorers_best_others(bench, wrapper) -> None:
    session, prompt, _, _ = bench
    scorer, recorded = kvpress.KnormPress(), []
    score = scorer.score
    scorer.score = lambda *a: recorded.append(score(*a).clone()) or recorded[-1].clone()  # the scorer's own scores
    press = scorer if wrapper is None else getattr(kvpress, wrapper)(press=scorer)
    cache = KVPress(name="knorm", press=press, keep_ratio=0.25, sinks=4).compress(session, prompt)
    n = prompt.context_ids.shape[1]
    for layer, scores in zip(cache.ragged, recorded, strict=True):
        scores = scores[0].double()  # (Hkv, T)
        scores[:, :4] = float("inf")
        kept = [set(layer.pos[layer.head_rows(h)].tolist()) for h in range(len(layer.caps))]
        assert all({0, 1, 2, 3} <= k for k in kept)
        if wrapper is None:  # per head: the sinks and the scorer's best of the rest, n_kept in all
            assert kept == [set(row.topk(int(n * 0.25)).indices.tolist()) for row in scores]
        else:  # AdaKV spreads the layer's budget over its heads
            assert sum(len(k) for k in kept) == len(kept) * int(n * 0.25)


@pytest.mark.parametrize("reduction", ["max", "rank"])
def test_token_layer_evicts_a_position_from_every_head_of_a_layer(bench, reduction) -> None:
    session, prompt, _, _ = bench
    scorer, recorded = kvpress.KnormPress(), []
    score = scorer.score
    scorer.score = lambda *a: recorded.append(score(*a).clone()) or recorded[-1].clone()
    method = KVPress(name="knorm", press=scorer, keep_ratio=0.25, scope="token_layer", reduction=reduction)
    cache = method.compress(session, prompt)
    n = prompt.context_ids.shape[1]
    for layer, scores in zip(cache.ragged, recorded, strict=True):
        s = scores[0].double()  # (Hkv, T)
        if reduction == "rank":  # a position's best quantile within a head, by counting
            s = torch.stack([(row[None, :] < row[:, None]).sum(dim=1) / (n - 1) for row in s])
        best = s.amax(dim=0)  # (T,) a position's best score over the layer's heads
        kept = [layer.pos[layer.head_rows(h)].sort().values for h in range(len(layer.caps))]
        assert all(torch.equal(k, kept[0]) for k in kept)  # one decision for every head of the layer
        # the best positions, up to ties at the cut (ranks tie across heads)
        assert torch.equal(best[kept[0]].sort().values, best.topk(int(n * 0.25)).values.sort().values)


def test_sinks_and_scopes_need_a_scorer() -> None:
    with pytest.raises(KVResearchError, match="sinks=0"):
        KVPress(name="think", press=kvpress.ThinKPress(key_channel_compression_ratio=0.5), sinks=4)
    with pytest.raises(KVResearchError, match="every layer"):
        KVPress(name="knorm", press=kvpress.KnormPress(), keep_ratio=0.5, scope="token_model")
    with pytest.raises(KVResearchError, match="needs a token scope"):
        KVPress(name="knorm", press=kvpress.KnormPress(), keep_ratio=0.5, reduction="rank")


def test_the_docs_table_is_the_catalog() -> None:
    from kvresearch.models.press_catalog import markdown

    assert markdown() in (Path(CONF_DIR).parent / "docs" / "presses.md").read_text()
