"""Methods behind one interface: kvpress baselines with real eviction, KVzip oracle, fixed budgets."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from transformers import DynamicCache

from kvresearch.cache import ragged_attention_enabled
from kvresearch.generation import build_prompt
from kvresearch.methods.base import Session, cache_from_scores, dense_prefill
from kvresearch.methods.kvzip import KVzipMethod
from kvresearch.models import ModelAdapter
from kvresearch.ops.selection import keep_topk
from kvresearch.runs import CONF_DIR

PRESSES = ["snapkv", "streaming_llm", "expected_attention", "tova", "knorm", "pyramidkv", "observed_attention"]


def method_config(name: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(f"method/{name}", overrides=[f"method.{o}" for o in overrides or []]).method


@pytest.fixture(scope="module")
def session(tiny):
    return Session(ModelAdapter(tiny.model), tiny.tokenizer)


@pytest.fixture(scope="module")
def prompt(tiny):
    text = "The tiny model reads a long context about rivers, mountains and the people who map them. " * 12
    return build_prompt(tiny.tokenizer, text, "What is it about?")


def next_logits_ragged(session, cache, token=11):
    with ragged_attention_enabled(session.model), torch.no_grad():
        return session.model(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]


@pytest.mark.parametrize("name", PRESSES)
def test_kvpress_baseline_with_real_eviction_matches_kvpress(name, session, prompt) -> None:
    method = instantiate(method_config(name, ["press.compression_ratio=0.5"]))
    cache = method.compress(session, prompt)
    n = prompt.context_ids.shape[1]
    stats = cache.stats()
    assert 0.4 <= stats["prune_ratio"] <= 0.6, stats["prune_ratio"]
    assert stats["kv_bytes"]["allocated"] < 0.65 * stats["kv_bytes"]["dense"] * 1.2
    assert cache.get_seq_length() == n
    ours = next_logits_ragged(session, cache)
    # kvpress itself: the pressed DynamicCache, next token at the original position n.
    press = instantiate(method_config(name, ["press.compression_ratio=0.5"])).press
    model = session.model
    if name == "observed_attention":
        model.set_attn_implementation("eager")
    dense = DynamicCache()
    with torch.no_grad():
        with press(model):
            model(input_ids=prompt.context_ids, past_key_values=dense, use_cache=True)
        model.set_attn_implementation("sdpa")
        theirs = model(
            input_ids=torch.tensor([[11]]),
            past_key_values=dense,
            use_cache=True,
            position_ids=torch.tensor([[n]]),
            cache_position=torch.tensor([dense.get_seq_length()]),
        ).logits[0, -1]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_fixed_budget_scopes() -> None:
    g = torch.Generator().manual_seed(0)
    scores = [torch.randn(2, 50, generator=g) for _ in range(3)]
    scores[1] += 3  # layer 1 matters more
    head = keep_topk(scores, 0.2, "head")
    assert all(len(k) == 10 for layer in head for k in layer)
    layer = keep_topk(scores, 0.2, "layer")
    assert all(sum(len(k) for k in heads) == 20 for heads in layer)
    assert len({len(k) for heads in layer for k in heads}) > 1
    glob = keep_topk(scores, 0.2, "global")
    assert sum(len(k) for heads in glob for k in heads) == 60 and sum(len(k) for k in glob[1]) > 40
    flat = torch.cat([s.flatten() for s in scores])
    kept_values = torch.cat([scores[i][h, k] for i, heads in enumerate(glob) for h, k in enumerate(heads)])
    assert kept_values.min() >= flat.topk(60).values.min()


def test_kvzip_oracle_method_keeps_the_head_and_the_budget(session, prompt) -> None:
    method = KVzipMethod(plus=True, keep_ratio=0.4, scope="global", chunk_size=64)
    cache = method.compress(session, prompt)
    stats = cache.stats()
    assert stats["prune_ratio"] == pytest.approx(0.6, abs=0.01)
    for layer in cache.ragged:
        for h in range(2):
            assert set(range(prompt.head_len)) <= set(layer.head_positions(h).tolist())
    assert torch.isfinite(next_logits_ragged(session, cache)).all()


def test_cache_from_scores_threshold_and_window(session, prompt) -> None:
    dense = dense_prefill(session, prompt.context_ids)
    n = prompt.context_ids.shape[1]
    scores = [torch.arange(n, dtype=torch.float).expand(2, n) for _ in range(3)]
    cache = cache_from_scores(dense, scores, threshold=n - 20.0, window=5)
    assert cache.ragged[0].head_positions(1).tolist() == list(range(n - 20, n))
    cache = cache_from_scores(dense, [-s for s in scores], threshold=-9.0, window=5, sinks=2)
    assert cache.ragged[2].head_positions(0).tolist() == [*range(10), *range(n - 5, n)]


def test_kvzap_fixed_budget_mode_keeps_the_window_and_the_ratio(session, prompt, tmp_path) -> None:
    from kvresearch.methods.kvzap import KVzapMethod
    from kvresearch.surrogate import Surrogate, SurrogateConfig

    adapter = session.adapter
    Surrogate(
        SurrogateConfig("linear", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads, model="tiny_random")
    ).save(tmp_path)
    for scope in ("head", "layer", "global"):
        method = KVzapMethod(str(tmp_path), keep_ratio=0.5, scope=scope, window=16, expect_model="tiny_random")
        cache = method.compress(session, prompt)
        n = prompt.context_ids.shape[1]
        assert cache.stats()["prune_ratio"] == pytest.approx(0.5, abs=0.01)
        for layer in cache.ragged:
            for h in range(adapter.num_kv_heads):
                assert set(range(n - 16, n)) <= set(layer.head_positions(h).tolist())


def test_kvpress_own_kvzap_config_with_our_export(session, prompt, tmp_path) -> None:
    from kvresearch.surrogate import Surrogate, SurrogateConfig
    from kvresearch.surrogate.export import to_kvpress

    adapter = session.adapter
    torch.manual_seed(0)
    to_kvpress(
        Surrogate(SurrogateConfig("mlp", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads)), tmp_path
    )
    cfg = method_config("kvpress_kvzap", [f"press.surrogate_path={tmp_path}", "press.threshold=0.0", "press.window=16"])
    cache = instantiate(cfg).compress(session, prompt)
    n = prompt.context_ids.shape[1]
    assert 0.0 < cache.stats()["prune_ratio"] < 1.0
    assert all(set(range(n - 16, n)) <= set(layer.head_positions(0).tolist()) for layer in cache.ragged)
    assert torch.isfinite(next_logits_ragged(session, cache)).all()


@pytest.mark.slow
def test_kvpress_own_kvzip_press_on_the_embedded_model(smol) -> None:
    sess = Session(ModelAdapter(smol.model), smol.tokenizer)
    prompt = build_prompt(smol.tokenizer, "The capital of France is Paris. " * 20, "What is the capital of France?")
    cache = instantiate(method_config("kvpress_kvzip", ["press.compression_ratio=0.5"])).compress(sess, prompt)
    assert cache.stats()["prune_ratio"] == pytest.approx(0.5, abs=0.02)
    assert cache.get_seq_length() == prompt.context_ids.shape[1]
