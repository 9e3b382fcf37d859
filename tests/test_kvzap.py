"""KVzap pruning with real eviction: the rule, chunked prefill, decoding, and kvpress side by side."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvresearch.methods.kvzap import ThresholdPruner
from kvresearch.models import ModelAdapter
from kvresearch.models.cache import RaggedCache
from kvresearch.models.hooks import after_attention, attention_inputs
from kvresearch.models.ragged_attention import ragged_attention_enabled
from kvresearch.surrogate import Surrogate, SurrogateConfig

pytestmark = pytest.mark.compat  # also run on the GPU image's versions (make compat)

T, WINDOW = 200, 32


def random_surrogate(adapter: ModelAdapter, kind: str = "mlp") -> Surrogate:
    torch.manual_seed(0)
    return Surrogate(SurrogateConfig(kind, adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads)).eval()


def dense_scores(model, adapter, surrogate, ids):
    """Surrogate scores of every token from one dense forward pass: {layer: (Hkv, T)}."""
    inputs: dict[int, torch.Tensor] = {}
    with torch.no_grad(), attention_inputs(adapter, inputs):
        model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True)
        return {i: surrogate.forward_layer(i, inputs[i][0]).T for i in inputs}


def prefill(model, adapter, pruner, ids, chunk=None):
    cache = RaggedCache(adapter.num_layers)
    with ragged_attention_enabled(model), torch.no_grad(), pruner.attach(adapter, cache):
        for start in range(0, ids.shape[1], chunk or ids.shape[1]):
            model(input_ids=ids[:, start : start + (chunk or ids.shape[1])], past_key_values=cache, use_cache=True)
    return cache, cache.stats()


@pytest.fixture
def setup(tiny):
    adapter = ModelAdapter(tiny.model)
    ids = torch.randint(3, 4000, (1, T), generator=torch.Generator().manual_seed(0))
    surrogate = random_surrogate(adapter)
    scores = dense_scores(tiny.model, adapter, surrogate, ids)
    return tiny.model, adapter, ids, surrogate, scores, threshold_between(scores, 0.5)


def threshold_between(scores, quantile: float) -> float:
    """A threshold near ``quantile`` in the widest gap between neighbouring scores (robust to float noise)."""
    values = torch.cat([s.flatten() for s in scores.values()]).sort().values
    mid = int(quantile * len(values))
    gaps = values[mid - 50 : mid + 50].diff()
    i = mid - 50 + int(gaps.argmax())
    return float(values[i] + values[i + 1]) / 2


def test_single_pass_prefill_evicts_exactly_the_low_scores_outside_the_window(setup) -> None:
    model, adapter, ids, surrogate, scores, tau = setup
    cache, stats = prefill(model, adapter, ThresholdPruner(surrogate, tau, window=WINDOW), ids)
    for index, layer in enumerate(cache.ragged):
        for h in range(adapter.num_kv_heads):
            s = scores[index][h]
            expected = [i for i in range(T) if i >= T - WINDOW or s[i] >= tau]
            assert layer.head_positions(h).tolist() == expected
    assert 0.3 < stats["prune_ratio"] < 0.6 and stats["tokens_seen"] == T * 3 * 2
    assert cache.kv_bytes()["allocated"] == stats["tokens_kept"] * cache.ragged[0].entry_bytes()


@pytest.mark.parametrize("reduction", ["max", "mean"])
def test_token_layer_threshold_evicts_a_position_from_every_head_by_its_score_over_them(setup, reduction) -> None:
    model, adapter, ids, surrogate, scores, tau = setup
    pruner = ThresholdPruner(surrogate, tau, window=WINDOW, sinks=3, token_layer=True, reduction=reduction)
    cache, _ = prefill(model, adapter, pruner, ids)
    reduce = {"max": lambda s: s.max(dim=0).values, "mean": lambda s: s.mean(dim=0)}[reduction]
    for index, layer in enumerate(cache.ragged):
        shared = reduce(scores[index].double())
        expected = [i for i in range(T) if i < 3 or i >= T - WINDOW or shared[i] >= tau]
        assert [layer.head_positions(h).tolist() for h in range(adapter.num_kv_heads)] == [expected] * 2
    chunked, stats = prefill(model, adapter, pruner, ids, chunk=48)
    for layer in chunked.ragged:  # a chunked prefill meets other scores, but still one decision per position
        assert layer.head_positions(0).tolist() == layer.head_positions(1).tolist()
        assert set(range(T - WINDOW, T)) | {0, 1, 2} <= set(layer.head_positions(0).tolist())
    assert 0.0 < stats["prune_ratio"] < 1.0


def test_chunked_prefill_keeps_the_window_and_only_evicts_below_threshold(setup) -> None:
    model, adapter, ids, surrogate, _, tau = setup
    inputs: dict[int, list[torch.Tensor]] = {}
    peak = []

    pruner = ThresholdPruner(surrogate, tau, window=WINDOW)
    cache = RaggedCache(adapter.num_layers)
    with ragged_attention_enabled(model), torch.no_grad(), pruner.attach(adapter, cache):
        for start in range(0, T, 50):
            captured: dict[int, torch.Tensor] = {}
            with attention_inputs(adapter, captured):
                model(input_ids=ids[:, start : start + 50], past_key_values=cache, use_cache=True)
            for i, h in captured.items():
                inputs.setdefault(i, []).append(h[0])
            peak.append(cache.kv_bytes()["allocated"])
    for index, layer in enumerate(cache.ragged):
        s = surrogate.forward_layer(index, torch.cat(inputs[index])).T
        for h in range(adapter.num_kv_heads):
            kept = set(layer.head_positions(h).tolist())
            assert set(range(T - WINDOW, T)) <= kept
            evicted = set(range(T)) - kept
            assert all(float(s[h, i]) < tau for i in evicted) and all(
                float(s[h, i]) >= tau or i >= T - WINDOW for i in kept
            )
    entry = cache.ragged[0].entry_bytes()
    assert max(peak) <= (max(sum(layer.lengths.tolist()) for layer in cache.ragged) + 50 * 2) * entry * 3
    assert cache.stats()["prune_ratio"] > 0.2


def test_a_threshold_that_evicts_everything_still_keeps_the_window(setup) -> None:
    model, adapter, ids, surrogate, _, _ = setup
    cache, _ = prefill(model, adapter, ThresholdPruner(surrogate, float("inf"), window=WINDOW), ids)
    assert all(layer.kept_per_head().tolist() == [WINDOW, WINDOW] for layer in cache.ragged)
    # Decoding with the pruner attached keeps the cache at the window.
    pruner = ThresholdPruner(surrogate, float("inf"), window=WINDOW)
    with ragged_attention_enabled(model), torch.no_grad(), pruner.attach(adapter, cache):
        for _ in range(10):
            model(input_ids=torch.tensor([[7]]), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == T + 10
    assert all(layer.kept_per_head().tolist() == [WINDOW, WINDOW] for layer in cache.ragged)
    assert all(layer.head_positions(0).min() == T + 10 - WINDOW for layer in cache.ragged)


def test_sinks_are_never_evicted_in_prefill_or_decoding(setup) -> None:
    model, adapter, ids, surrogate, _, _ = setup
    pruner = ThresholdPruner(surrogate, float("inf"), window=WINDOW, sinks=4)
    cache, _ = prefill(model, adapter, pruner, ids, chunk=64)
    expected = [*range(4), *range(T - WINDOW, T)]
    assert all(layer.head_positions(h).tolist() == expected for layer in cache.ragged for h in range(2))
    with ragged_attention_enabled(model), torch.no_grad(), pruner.attach(adapter, cache):
        for _ in range(5):
            model(input_ids=torch.tensor([[7]]), past_key_values=cache, use_cache=True)
    expected = [*range(4), *range(T + 5 - WINDOW, T + 5)]
    assert all(layer.head_positions(h).tolist() == expected for layer in cache.ragged for h in range(2))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_same_evictions_as_kvpress_dms_kvzap_which_keeps_the_memory(setup, tmp_path, kind) -> None:
    from kvpress import DMSPress, KVzapPress

    from kvresearch.models.presses import cache_positions
    from kvresearch.surrogate.export import to_kvpress

    model, adapter, ids, _, _, _ = setup
    surrogate = random_surrogate(adapter, kind)
    scores = dense_scores(model, adapter, surrogate, ids)
    tau = threshold_between(scores, 0.4)
    ours, _ = prefill(model, adapter, ThresholdPruner(surrogate, tau, window=WINDOW), ids)

    to_kvpress(surrogate, tmp_path)
    from kvpress.presses.kvzap_press import KVzapModel

    scorer = KVzapPress(model_type=kind)
    scorer.kvzap_model_name = f"nvidia/KVzap-{kind}-{model.config.name_or_path.split('/')[-1]}"
    scorer.kvzap_model = KVzapModel.from_pretrained(tmp_path)
    press = DMSPress(scorer, threshold=tau, sliding_window_size=WINDOW)
    dense = DynamicCache()
    with torch.no_grad(), cache_positions(adapter), press(model):  # what transformers < 5.17 passes kvpress
        model(input_ids=ids, past_key_values=dense, use_cache=True)
    for index, spec in enumerate(adapter.layers):
        _, heads, positions = (t.tolist() for t in spec.attn.masked_key_indices)
        theirs = {(h, p) for h, p in zip(heads, positions, strict=True)}
        mine = {(h, p) for h in range(adapter.num_kv_heads) for p in range(T)} - {
            (h, p) for h in range(adapter.num_kv_heads) for p in ours.ragged[index].head_positions(h).tolist()
        }
        assert mine == theirs
        assert dense.layers[index].keys.shape[2] == T  # kvpress keeps every pair in memory
    assert ours.kv_bytes()["kept"] < 0.8 * ours.kv_bytes()["dense"]


def test_kvpress_dms_with_our_surrogate_in_memory_evicts_the_same_pairs(setup) -> None:
    from kvresearch.methods.baselines import kvzap_press
    from kvresearch.models import Session
    from kvresearch.models.presses import masked_pairs

    model, adapter, ids, surrogate, _, tau = setup
    ours, _ = prefill(model, adapter, ThresholdPruner(surrogate, tau, window=WINDOW), ids)
    mine = {
        (i, h, p)
        for i, layer in enumerate(ours.ragged)
        for h in range(adapter.num_kv_heads)
        for p in set(range(T)) - set(layer.head_positions(h).tolist())
    }
    theirs, kept_bytes = masked_pairs(Session(adapter, None), ids, kvzap_press(surrogate, tau, WINDOW))
    assert mine == theirs and len(mine) > 0
    assert kept_bytes > ours.kv_bytes()["allocated"]  # kvpress keeps every pair in memory


def test_a_memory_budget_holds_at_every_step_and_keeps_the_top_scored(setup) -> None:
    model, adapter, ids, surrogate, scores, _ = setup
    tau, budget = threshold_between(scores, 0.3), 60
    cache = RaggedCache(adapter.num_layers)
    seen_scores: dict[int, dict[int, torch.Tensor]] = {i: {} for i in range(adapter.num_layers)}
    score_layer = surrogate.forward_layer

    def spy(index: int, h: torch.Tensor) -> torch.Tensor:  # the scores the pruner computes, by position
        out = score_layer(index, h)
        for j, p in enumerate(cache.ragged[index].new_positions.tolist()):
            seen_scores[index][p] = out[j]
        return out

    surrogate.forward_layer = spy  # type: ignore[method-assign]
    largest: list[int] = []
    pruner = ThresholdPruner(surrogate, tau, window=WINDOW, max_entries=budget)
    record = lambda i: largest.append(int(cache.ragged[i].kept_per_head().max()))
    with (
        ragged_attention_enabled(model),
        torch.no_grad(),
        pruner.attach(adapter, cache),
        after_attention(adapter, record),
    ):
        for start in range(0, T, 50):
            model(input_ids=ids[:, start : start + 50], past_key_values=cache, use_cache=True)
        for step in range(40):
            model(input_ids=torch.tensor([[5 + step]]), past_key_values=cache, use_cache=True)
    assert len(largest) == adapter.num_layers * (T // 50 + 40) and max(largest) <= budget
    n = T + 40
    for index, layer in enumerate(cache.ragged):
        for h in range(adapter.num_kv_heads):
            old = [p for p in range(n - WINDOW) if float(seen_scores[index][p][h]) >= tau]
            top = sorted(old, key=lambda p: -float(seen_scores[index][p][h]))[: budget - WINDOW]
            assert layer.head_positions(h).tolist() == sorted(top + list(range(n - WINDOW, n)))  # brute force
    assert max(largest) == budget  # the budget bound, not the threshold, is what held the cache


def test_a_budget_not_above_the_window_is_refused(tiny) -> None:
    from kvresearch.errors import KVResearchError
    from kvresearch.methods.kvzap import KVzap

    with pytest.raises(KVResearchError, match="must exceed the window"):
        KVzap(surrogate=random_surrogate(ModelAdapter(tiny.model)), window=64, max_entries=64)
