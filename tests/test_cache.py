"""The ragged compressed cache: exactness against dense attention, eviction, positions, memory."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvresearch.errors import KVResearchError
from kvresearch.models import ModelAdapter
from kvresearch.models.cache import RaggedCache, RaggedLayer
from kvresearch.models.ragged_attention import ragged_attention_enabled
from kvresearch.ops import attention
from kvresearch.ops.attention import dense_reference, ragged_attention, uniform_stride
from tests.helpers import tiny_family

pytestmark = pytest.mark.compat  # also run on the GPU image's versions (make compat)


def packed(keys, values, bias, pos):
    """Pack per-head lists into the ragged layout."""
    lengths = torch.tensor([len(k) for k in keys])
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.cat(keys), torch.cat(values), torch.cat(bias), torch.cat(pos), starts, lengths


@pytest.mark.parametrize("window", [None, 5])
def test_ragged_attention_equals_dense_brute_force(window) -> None:
    g = torch.Generator().manual_seed(0)
    hq, hkv, n, d, t = 6, 3, 20, 8, 4
    k, v = torch.randn(hkv, n, d, generator=g), torch.randn(hkv, n, d, generator=g)
    bias = torch.randn(hkv, n, generator=g)
    q = torch.randn(hq, t, d, generator=g)
    q_pos = torch.arange(n - t, n)
    keep = [torch.randperm(n, generator=g)[: 5 + 4 * h].sort().values for h in range(hkv)]  # ragged
    keep[0] = torch.cat([keep[0], torch.arange(n - t, n)]).unique()
    ours = ragged_attention(
        q,
        q_pos,
        *packed(
            [k[h, keep[h]] for h in range(hkv)],
            [v[h, keep[h]] for h in range(hkv)],
            [bias[h, keep[h]] for h in range(hkv)],
            keep,
        ),
        0.3,
        window=window,
    )
    visible = torch.zeros(hkv, t, n, dtype=torch.bool)
    for h in range(hkv):
        visible[h][:, keep[h]] = True
    delta = q_pos[:, None] - torch.arange(n)[None]
    visible &= (delta >= 0) if window is None else (delta >= 0) & (delta < window)
    torch.testing.assert_close(ours.double(), dense_reference(q, k, v, bias, visible, 0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["unbiased", "one_head_biased", "window"])
def test_ragged_decoding_attends_without_a_mask_where_every_entry_is_visible(case, monkeypatch) -> None:
    """Ragged heads after eviction, queries after every kept entry: unmasked per-head calls, as the brute force."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, n, d, t = 6, 3, 20, 8, 2
    k, v = torch.randn(hkv, n, d, generator=g), torch.randn(hkv, n, d, generator=g)
    bias = torch.zeros(hkv, n)
    if case == "one_head_biased":
        bias[1] = torch.randn(n, generator=g)
    keep = [torch.randperm(n, generator=g)[: 4 + 5 * h].sort().values for h in range(hkv)]
    q, q_pos = torch.randn(hq, t, d, generator=g), torch.tensor([n, n + 1])
    window = 6 if case == "window" else None
    args = packed([k[h, keep[h]] for h in range(hkv)], [v[h, keep[h]] for h in range(hkv)],
                  [bias[h, keep[h]] for h in range(hkv)], keep)  # fmt: skip
    seen = calls(monkeypatch)
    ours = ragged_attention(q, q_pos, *args, 0.3, window=window).double()
    masked = {"unbiased": [False] * 3, "one_head_biased": [False, True, False], "window": [True] * 3}[case]
    assert [c["mask"] for c in seen] == masked
    visible = torch.zeros(hkv, t, n, dtype=torch.bool)
    for h in range(hkv):
        visible[h][:, keep[h]] = True
    delta = q_pos[:, None] - torch.arange(n)[None]
    visible &= (delta >= 0) if window is None else (delta >= 0) & (delta < window)
    torch.testing.assert_close(ours, dense_reference(q, k, v, bias, visible, 0.3), rtol=1e-5, atol=1e-6)


def calls(monkeypatch) -> list[dict]:
    """The keyword arguments of every sdpa call ``ragged_attention`` makes from now on."""
    seen: list[dict] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append({"causal": kwargs.get("is_causal", False), "mask": kwargs.get("attn_mask") is not None})
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("window", [None, 64, 5])
def test_fresh_prefill_takes_the_causal_path_and_agrees_with_brute_force(window, monkeypatch) -> None:
    g = torch.Generator().manual_seed(1)
    hq, hkv, n, d = 4, 2, 12, 8
    k, v, q = (
        torch.randn(hkv, n, d, generator=g),
        torch.randn(hkv, n, d, generator=g),
        torch.randn(hq, n, d, generator=g),
    )
    args = packed(list(k), list(v), [torch.zeros(n)] * hkv, [torch.arange(n)] * hkv)
    seen = calls(monkeypatch)
    ours = ragged_attention(q, torch.arange(n), *args, 0.3, window=window).double()
    assert seen == [{"causal": window != 5, "mask": window == 5}]  # one call for all heads; a cut window masks
    delta = torch.arange(n)[:, None] - torch.arange(n)[None]
    visible = ((delta >= 0) if window is None else (delta >= 0) & (delta < window)).expand(hkv, n, n)
    expected = dense_reference(q, k, v, torch.zeros(hkv, n), visible, 0.3)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["full", "bias", "evicted", "window", "chunk"])
def test_uniform_heads_attend_in_one_call_over_padded_buffers(case, monkeypatch) -> None:
    """Heads with as many entries, at a stride wider than they hold (growth slack, garbage there): brute force."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, n, d, slack = 6, 3, 10, 8, 4
    t = 3 if case == "chunk" else 1
    k, v = torch.randn(hkv, n, d, generator=g), torch.randn(hkv, n, d, generator=g)
    bias = torch.zeros(hkv, n)
    if case == "bias":
        bias = torch.randn(hkv, n, generator=g)
    if case == "evicted":
        bias[1, 2:5] = float("-inf")
    pad = lambda x, fill: torch.cat([x, torch.full((hkv, slack, *x.shape[2:]), fill, dtype=x.dtype)], 1)
    pos = torch.arange(n).expand(hkv, n)
    packed_args = (pad(k, float("nan")).reshape(-1, d), pad(v, float("nan")).reshape(-1, d),
                   pad(bias, float("-inf")).reshape(-1), pad(pos, 0).reshape(-1),
                   torch.arange(hkv) * (n + slack), torch.full((hkv,), n))  # fmt: skip
    assert uniform_stride(packed_args[4], packed_args[5]) == n + slack
    q, q_pos = torch.randn(hq, t, d, generator=g), torch.arange(n - t, n) if case == "chunk" else torch.tensor([n])
    window = 4 if case == "window" else None
    seen = calls(monkeypatch)
    ours = ragged_attention(q, q_pos, *packed_args, 0.3, window=window).double()
    assert seen == [{"causal": False, "mask": case != "full"}]  # decoding from a full cache: no mask at all
    delta = q_pos[:, None] - torch.arange(n)[None]
    visible = ((delta >= 0) if window is None else (delta >= 0) & (delta < window)).expand(hkv, t, n).clone()
    visible &= (bias > float("-inf"))[:, None, :]
    torch.testing.assert_close(ours, dense_reference(q, k, v, bias.clamp(min=-1e9), visible, 0.3), rtol=1e-5, atol=1e-6)


def test_uniform_stride_reads_the_layout() -> None:
    assert uniform_stride(torch.tensor([0, 8, 16]), torch.tensor([5, 5, 5])) == 8
    assert uniform_stride(torch.tensor([0, 5, 10]), torch.tensor([5, 5, 4])) is None  # ragged
    assert uniform_stride(torch.tensor([0, 6, 14]), torch.tensor([5, 5, 5])) is None  # uneven capacities
    assert uniform_stride(torch.tensor([0]), torch.tensor([7])) == 7
    assert uniform_stride(torch.tensor([0, 0]), torch.tensor([0, 0])) is None  # empty


def test_query_with_every_entry_evicted_gets_zero() -> None:
    g = torch.Generator().manual_seed(2)
    k, v, q = torch.randn(1, 3, 4, generator=g), torch.randn(1, 3, 4, generator=g), torch.randn(1, 2, 4, generator=g)
    bias = torch.tensor([float("-inf"), float("-inf"), 0.0])  # query at position 1 sees only evicted entries
    out = ragged_attention(q, torch.tensor([1, 2]), *packed(list(k), list(v), [bias], [torch.arange(3)]), 0.5)
    assert torch.equal(out[0, 0], torch.zeros(4))
    torch.testing.assert_close(out[0, 1], v[0, 2])


def run_steps(model, cache, ids, steps=4):
    """Prefill ids (1, T) then greedy steps; returns the logits of every step."""
    logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]]
    for _ in range(steps):
        token = logits[-1].argmax().view(1, 1)
        logits.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits[0, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_ragged_cache_without_eviction_equals_full_attention(family) -> None:
    model = tiny_family(family)
    ids = torch.randint(0, 97, (1, 23), generator=torch.Generator().manual_seed(0))
    reference = run_steps(model, DynamicCache(), ids)
    adapter = ModelAdapter(model)
    with ragged_attention_enabled(model):
        cache = RaggedCache(adapter.num_layers, [layer.sliding_window for layer in adapter.layers])
        ours = run_steps(model, cache, ids)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    assert cache.get_seq_length() == 23 + 4
    assert model.config._attn_implementation == "sdpa"  # restored


def test_sliding_layers_drop_out_of_window_entries_and_attention_is_unchanged() -> None:
    """Tiny Gemma-3 (window 8): prefill 23, compact (the sliding layers keep 16..22), 70 greedy steps (they
    grow past the slack and drop again): the logits equal those of transformers' own cache."""
    model = tiny_family("gemma3")
    ids = torch.randint(0, 97, (1, 23), generator=torch.Generator().manual_seed(0))
    reference = run_steps(model, DynamicCache(), ids, steps=70)
    adapter = ModelAdapter(model)
    windows = [layer.sliding_window for layer in adapter.layers]
    with ragged_attention_enabled(model):
        cache = RaggedCache(adapter.num_layers, windows)
        logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]]
        cache.compact()
        assert [cache.ragged[i].head_positions(1).tolist() for i in range(3)] == [list(range(16, 23))] * 2 + [
            list(range(23))
        ]
        for _ in range(70):
            token = logits[-1].argmax().view(1, 1)
            logits.append(model(input_ids=token, past_key_values=cache, use_cache=True).logits[0, -1])
    torch.testing.assert_close(torch.stack(logits), reference, rtol=1e-6, atol=1e-6)
    sliding = cache.ragged[0]
    assert int(sliding.lengths.max()) < 93 and int(sliding.head_positions(0).min()) > 93 - 8 - 64 - 1
    assert cache.stats()["prune_ratio"] == 0.0  # the window is the model's own, not an eviction
    assert cache.kv_bytes()["kept"] < cache.kv_bytes()["dense"]


def test_eviction_equals_attention_restricted_to_kept_entries_and_positions_continue() -> None:
    model = tiny_family("llama")
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    drop = {(layer, h): torch.randperm(30, generator=g)[: 6 + 5 * h] for layer in range(3) for h in range(2)}
    bias = {(layer, h): torch.randn(30, generator=g) for layer in range(3) for h in range(2)}

    # Ours: prefill, evict (ragged per head), add a bias, compact; then one decoding step.
    with ragged_attention_enabled(model):
        cache = RaggedCache(3)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        before = cache.kv_bytes()["allocated"]
        for layer_index, layer in enumerate(cache.ragged):
            for h in range(2):
                layer.set_bias(h, bias[layer_index, h])
                layer.evict(h, drop[layer_index, h])
        cache.compact()
        assert cache.kv_bytes()["allocated"] < before  # memory falls
        assert cache.get_seq_length() == 30  # the next token is at position 30, not at the kept count
        ours = model(input_ids=torch.tensor([[5]]), past_key_values=cache, use_cache=True).logits[0, -1]
        assert cache.ragged[0].new_positions.tolist() == [30]

    # Reference: dense cache, float64 brute-force attention with the same per-head visibility and bias.
    def masked(module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer_index = int(module.layer_idx)
        n = key.shape[2]
        visible = torch.ones(2, query.shape[2], n, dtype=torch.bool)
        full_bias = torch.zeros(2, n)
        for h in range(2):
            visible[h][:, drop[layer_index, h]] = False
            full_bias[h, :30] = bias[layer_index, h]
        out = dense_reference(query[0], key[0], value[0], full_bias, visible, scaling)
        return out.to(query.dtype).transpose(0, 1)[None], None

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register("test_masked", masked)
    dense = DynamicCache()
    model(input_ids=ids, past_key_values=dense, use_cache=True)
    model.set_attn_implementation("test_masked")
    try:
        reference = model(input_ids=torch.tensor([[5]]), past_key_values=dense, use_cache=True).logits[0, -1]
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    kept = cache.ragged[1].kept_per_head().tolist()
    assert kept == [31 - 6, 31 - 11]


def test_append_grows_and_compact_shrinks_storage() -> None:
    layer = RaggedLayer()
    k = torch.randn(1, 2, 10, 4)
    layer.update(k, k, {"cache_position": torch.arange(10)})
    for step in range(10, 40):
        layer.update(k[:, :, :1], k[:, :, :1], {"cache_position": torch.tensor([step])})
    assert layer.lengths.tolist() == [40, 40] and bool((layer.caps >= 40).all())
    layer.evict(0, torch.arange(0, 30))
    layer.compact()
    assert layer.lengths.tolist() == [10, 40] and layer.k.shape[0] == 50
    assert layer.head_positions(0).tolist() == list(range(30, 40))
    assert layer.kv_bytes()["kept"] == 50 * layer.entry_bytes()


def test_sliding_layer_drops_what_no_later_query_sees_and_counts_what_it_shows() -> None:
    layer = RaggedLayer(window=8)
    k = torch.randn(1, 2, 20, 4)
    layer.update(k, k, {"cache_position": torch.arange(20)})
    layer.evict(0, torch.tensor([3, 15]))  # one evicted entry outside the window, one inside
    layer.evict(1, torch.tensor([16]))
    layer.compact()
    # The next query sits at 20 and sees 13..20: positions 13..19 stay, less the evicted ones.
    assert layer.head_positions(0).tolist() == [13, 14, 16, 17, 18, 19]
    assert layer.head_positions(1).tolist() == [13, 14, 15, 17, 18, 19]
    assert layer.stored_per_head().tolist() == [6, 6]
    assert layer.kept_per_head().tolist() == [18, 19]  # 20 seen, less what each head's method evicted
    assert layer.visible_per_head().tolist() == [6, 6] and layer.span(20) == 7  # what the next query sees
    assert layer.kv_bytes()["kept"] == 12 * layer.entry_bytes()
    for step in range(20, 120):  # decoding: the layer never holds more than the window plus the growth slack
        layer.update(k[:, :, :1], k[:, :, :1], {"cache_position": torch.tensor([step])})
        assert int(layer.lengths.max()) <= 7 + 64 + 1
        assert set(range(max(step - 6, 17), step + 1)) <= set(layer.head_positions(1).tolist())  # 16 was evicted
    assert layer.kept_per_head().tolist() == [118, 119]
    assert layer.visible_per_head().tolist() == [7, 7]  # the evicted entries have left the window


def test_the_prune_ratio_counts_only_what_a_sliding_layers_window_shows() -> None:
    """Global layer: 20 of 20 kept. Sliding layer (window 8): the next query (at 20) sees 13..19, 7 positions."""
    k = torch.randn(2, 20, 4)
    full = RaggedCache.from_layers([(k, k), (k, k)], windows=[None, 8])
    assert full.stats()["prune_ratio"] == 0.0 and full.stats()["tokens_seen"] == 2 * 20 + 2 * 7
    keep = [[torch.arange(20)] * 2, [torch.tensor([0, 1, 2, 15, 19]), torch.tensor([13, 14, 16, 17, 18, 19])]]
    cache = RaggedCache.from_layers([(k, k), (k, k)], keep, windows=[None, 8])
    stats = cache.stats()
    assert stats["kept_per_layer_head"] == [[20, 20], [2, 6]]  # 0, 1, 2 are out of the window: not kept
    assert stats["prune_ratio_per_layer"] == [0.0, pytest.approx(1 - 8 / 14)]
    assert stats["prune_ratio"] == pytest.approx(1 - 48 / 54)
    cache.compact()  # the hidden entries go; the count is the same
    assert cache.stats()["kept_per_layer_head"] == [[20, 20], [2, 6]]


def test_a_global_layer_keeps_everything_it_was_not_told_to_evict() -> None:
    layer = RaggedLayer()
    k = torch.randn(1, 2, 20, 4)
    layer.update(k, k, {"cache_position": torch.arange(20)})
    layer.compact()
    assert layer.head_positions(0).tolist() == list(range(20)) and layer.hidden.tolist() == [0, 0]


def test_batch_larger_than_one_is_refused() -> None:
    layer = RaggedLayer()
    with pytest.raises(KVResearchError, match="batch size 1"):
        layer.update(torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4))


def test_a_copy_with_slack_is_independent_and_appends_without_growing() -> None:
    g = torch.Generator().manual_seed(4)
    cache = RaggedCache.from_layers([(torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, 4, generator=g))])
    layer = cache.ragged[0]
    layer.evict(1, torch.tensor([2]))
    copied = cache.copy(slack=3)
    twin = copied.ragged[0]
    assert twin.caps.tolist() == [9, 9] and twin.lengths.tolist() == [6, 6] and twin.dead.tolist() == [0, 1]
    for h in range(2):
        for field in ("k", "v", "bias", "pos"):
            assert torch.equal(getattr(twin, field)[twin.head_rows(h)], getattr(layer, field)[layer.head_rows(h)])
    buffer = twin.k
    for step in range(3):  # the slack is used: no growth, no new buffer
        twin.append(torch.randn(2, 1, 4, generator=g), torch.randn(2, 1, 4, generator=g), torch.tensor([6 + step]))
    assert twin.k is buffer and twin.lengths.tolist() == [9, 9] and twin.stride == 9
    twin.evict(0, torch.tensor([0]))
    assert layer.lengths.tolist() == [6, 6] and layer.dead.tolist() == [0, 1] and bool(layer.alive(0).all())
