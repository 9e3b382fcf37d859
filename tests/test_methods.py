"""Methods behind one interface: kvpress baselines with real eviction, KVzip oracle, fixed budgets."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvresearch.errors import KVResearchError
from kvresearch.methods.base import cache_from_scores
from kvresearch.methods.kvzap import KVzap
from kvresearch.methods.kvzip import KVzip
from kvresearch.models import ModelAdapter, Session
from kvresearch.models.presses import _nearest_positions, _positions_of, cache_positions, kept_positions, row_hashes
from kvresearch.models.ragged_attention import ragged_attention_enabled
from kvresearch.ops.attention import uniform_stride
from kvresearch.ops.selection import (
    REDUCTIONS,
    keep_threshold,
    keep_topk,
    keep_topk_visible,
    position_scores,
    protect_window,
)
from kvresearch.prompts import build_prompt
from kvresearch.runs import build
from tests.helpers import method_config, surrogate_run

pytestmark = pytest.mark.compat  # also run on the GPU image's versions (make compat)

PRESSES = ["snapkv", "streaming_llm", "expected_attention", "tova", "knorm", "pyramidkv", "observed_attention"]


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
    method = build(method_config(name, ["keep_ratio=0.5"]))
    cache = method.compress(session, prompt)
    n = prompt.context_ids.shape[1]
    stats = cache.stats()
    assert 0.4 <= stats["prune_ratio"] <= 0.6, stats["prune_ratio"]
    assert stats["kv_bytes"]["allocated"] < 0.65 * stats["kv_bytes"]["dense"] * 1.2
    assert cache.get_seq_length() == n
    ours = next_logits_ragged(session, cache)
    # kvpress itself: the pressed DynamicCache, next token at the original position n.
    press = build(method_config(name, ["keep_ratio=0.5"])).press
    assert press.compression_ratio == 0.5
    model = session.model
    if name == "observed_attention":
        model.set_attn_implementation("eager")
    dense = DynamicCache()
    with torch.no_grad():
        with cache_positions(session.adapter), press(model):  # what transformers < 5.17 passes kvpress itself
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


def test_kept_rows_are_found_by_their_bytes_as_by_distance_and_ambiguity_falls_back_to_distance() -> None:
    g = torch.Generator().manual_seed(0)
    original = torch.randn(300, 16, generator=g)
    pick = torch.randperm(300, generator=g)[:120]
    for dtype in (torch.float32, torch.bfloat16):
        rows = original.to(dtype)
        assert torch.equal(_positions_of(rows[pick], rows), pick)
        assert torch.equal(_nearest_positions(rows[pick], rows), pick)
    twins = original.clone()
    twins[9] = twins[5]  # identical rows: the bytes cannot tell them apart, each is still used once
    found = _positions_of(twins[[5, 9, 20]], twins)
    assert sorted(found[:2].tolist()) == [5, 9] and found[2] == 20
    assert torch.equal(_positions_of(original[pick] + 1e-6, original), pick)  # not bitwise copies: nearest rows


def test_kept_pairs_are_found_by_hash_by_keys_else_values_and_rewritten_pairs_are_refused() -> None:
    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(200, 8, generator=g), torch.randn(200, 8, generator=g)
    values[7] = values[3]  # equal values (a repeated token): the keys still tell them apart
    key_hashes, value_hashes = row_hashes(keys), row_hashes(values)
    pick = torch.randperm(200, generator=g)[:50]
    assert torch.equal(kept_positions(keys[pick], values[pick], key_hashes, value_hashes), pick)
    moved = keys[pick] * 2  # keys rewritten (re-rotated), values copied: found by the values
    distinct = torch.randn(200, 8, generator=g)
    assert torch.equal(kept_positions(moved, distinct[pick], key_hashes, row_hashes(distinct)), pick)
    with pytest.raises(KVResearchError, match="rewrote both"):
        kept_positions(moved, values[pick] + 1, key_hashes, value_hashes)


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


def reduced_by_hand(s: torch.Tensor, p: int, reduction: str) -> float:
    """Position ``p``'s score over the heads of ``s`` (heads, n), written out (+inf where any head protects it)."""
    column = s[:, p].tolist()
    if float("inf") in column:
        return float("inf")
    if reduction == "max":
        return max(column)
    if reduction == "mean":
        return sum(column) / len(column)
    return max(sum(v < x for v in s[h].tolist()) / (s.shape[1] - 1) for h, x in enumerate(column))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("scope", ["token_layer", "token_model"])
def test_token_scopes_equal_a_brute_force_over_positions(scope, reduction) -> None:
    """One decision per position for every head of a layer (or every layer): its score over them ranks it."""
    g = torch.Generator().manual_seed(1)
    layers, heads, n, ratio = 3, 2, 40, 0.3
    scores = [torch.randn(heads, n, generator=g, dtype=torch.float64) for _ in range(layers)]
    scores[1][0, 5] = float("inf")  # protected in one head of one layer
    kept = keep_topk(scores, ratio, scope, reduction=reduction)
    groups = [[i] for i in range(layers)] if scope == "token_layer" else [list(range(layers))]
    for group in groups:  # the layers of a group meet by their best reduced score
        best = {p: max(reduced_by_hand(scores[i], p, reduction) for i in group) for p in range(n)}
        top = sorted(range(n), key=lambda p: -best[p])[: round(ratio * n)]
        expected = sorted(set(top) | {p for p in range(n) if best[p] == float("inf")})
        for i in group:
            assert all(torch.equal(k, kept[i][0]) for k in kept[i]), (scope, i)  # one decision for every head
            # the same positions, up to ties at the cut (a rank reduction ties positions across heads)
            assert sorted(best[p] for p in kept[i][0].tolist()) == sorted(best[p] for p in expected), (scope, i)
    with pytest.raises(ValueError, match="as many positions"):
        keep_topk([scores[0], scores[1][:, :30]], ratio, "token_model", reduction=reduction)


def pages_by_hand(best: dict[int, float], n: int, size: int, k: int) -> list[int]:
    """Whole pages of ``size`` positions, best page (its best position; the earlier on ties) first, until >= k."""
    pages = [list(range(a, min(n, a + size))) for a in range(0, n, size)]
    ranked = sorted(range(len(pages)), key=lambda i: (-max(best[p] for p in pages[i]), i))
    kept: list[int] = []
    for i in ranked:
        if len(kept) >= k:
            break
        kept += pages[i]
    return sorted(kept)


@pytest.mark.parametrize("size", [1, 4, 7])
@pytest.mark.parametrize("scope", ["token_layer", "token_model"])
def test_token_scopes_with_pages_keep_whole_pages_as_a_brute_force_does(scope, size) -> None:
    """A page (positions [iP, (i+1)P), the last one shorter) scores its best position; the best pages fill k."""
    g = torch.Generator().manual_seed(3)
    layers, heads, n, ratio = 3, 2, 40, 0.3  # 40 positions: the last page of 7 holds 5
    scores = [torch.randn(heads, n, generator=g, dtype=torch.float64) for _ in range(layers)]
    scores[1][0, 22] = float("inf")  # protected: its page is kept whole
    kept = keep_topk(scores, ratio, scope, page_size=size)
    groups = [[i] for i in range(layers)] if scope == "token_layer" else [list(range(layers))]
    for group in groups:
        best = {p: max(float(scores[i][:, p].max()) for i in group) for p in range(n)}
        expected = pages_by_hand(best, n, size, round(ratio * n))
        for i in group:
            assert [k.tolist() for k in kept[i]] == [expected] * heads, (scope, size, i)
    if size == 1:
        assert [[k.tolist() for k in layer] for layer in kept] == [
            [k.tolist() for k in layer] for layer in keep_topk(scores, ratio, scope)
        ]
    else:
        assert all(22 in layer[0].tolist() and (22 // size) * size in layer[0].tolist() for layer in kept[1:2])
    with pytest.raises(ValueError, match="page_size"):
        keep_topk(scores, ratio, "head", page_size=size + 1)
    with pytest.raises(ValueError, match="page_size"):
        keep_topk(scores, ratio, scope, page_size=0)


@pytest.mark.parametrize("reduction", ["max", "mean"])
def test_a_threshold_under_token_layer_keeps_a_position_by_its_score_over_the_heads(reduction) -> None:
    g = torch.Generator().manual_seed(5)
    scores = [torch.randn(3, 30, generator=g, dtype=torch.float64) for _ in range(2)]
    kept = keep_threshold(scores, 0.4, "token_layer", reduction)
    for s, heads in zip(scores, kept, strict=True):
        want = [p for p in range(30) if reduced_by_hand(s, p, reduction) >= 0.4]
        assert [k.tolist() for k in heads] == [want] * 3
    per_head = keep_threshold(scores, 0.4)
    assert [k.tolist() for k in per_head[0]] == [torch.nonzero(r >= 0.4).view(-1).tolist() for r in scores[0]]


def test_a_sliding_layer_with_pages_holds_the_page_its_window_starts_in() -> None:
    g = torch.Generator().manual_seed(4)
    windows, n, size = [None, 9], 24, 5  # the window shows positions 16..23; their first page starts at 15
    scores = [torch.randn(2, n, generator=g) for _ in windows]
    kept = keep_topk_visible(scores, 0.5, "token_layer", windows, page_size=size)
    expected = keep_topk([scores[0], scores[1][:, 15:]], 0.5, "token_layer", page_size=size)
    assert [k.tolist() for k in kept[0]] == [k.tolist() for k in expected[0]]
    assert [k.tolist() for k in kept[1]] == [(k + 15).tolist() for k in expected[1]]
    assert all(int(k.min()) >= 15 for k in kept[1])


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_token_layer_global_spends_one_budget_over_the_layers_as_a_brute_force_does(reduction) -> None:
    g = torch.Generator().manual_seed(6)
    layers, heads, n, ratio = 3, 2, 30, 0.3
    scores = [torch.randn(heads, n, generator=g, dtype=torch.float64) + i for i in range(layers)]  # layer 2 runs high
    scores[0][1, 4] = float("inf")  # protected in one head: kept in both
    kept = keep_topk(scores, ratio, "token_layer_global", reduction=reduction)
    pairs = {(i, p): reduced_by_hand(scores[i], p, reduction) for i in range(layers) for p in range(n)}
    top = sorted(pairs, key=lambda ip: -pairs[ip])[: round(ratio * layers * n)]
    for i in range(layers):
        assert all(torch.equal(k, kept[i][0]) for k in kept[i]), i  # one decision for every head of a layer
        if reduction != "rank":  # no ties: the same pairs
            assert kept[i][0].tolist() == sorted(p for layer, p in top if layer == i), i
    mine = sorted(pairs[(i, p)] for i in range(layers) for p in kept[i][0].tolist())
    assert mine == sorted(pairs[ip] for ip in top)  # up to ties at the cut (ranks tie across layers)
    counts = [len(layer[0]) for layer in kept]
    assert sum(counts) == round(ratio * layers * n)
    if reduction != "rank":  # ranks are quantiles within a layer, blind to a layer whose scores run higher
        assert counts[2] > counts[0]  # the layers keep unevenly
    with pytest.raises(KVResearchError, match="decides per head"):
        KVzip(threshold=-3.0, scope="token_layer_global")


def test_position_scores_reduce_over_the_heads_as_a_brute_force_does() -> None:
    torch.manual_seed(0)
    s = torch.randn(3, 12, dtype=torch.float64)
    s[1, -2:] = float("inf")  # protected in one head
    for reduction in REDUCTIONS:
        want = torch.tensor([reduced_by_hand(s, p, reduction) for p in range(12)], dtype=torch.float64)
        assert torch.allclose(position_scores(s, reduction), want), reduction
    with pytest.raises(ValueError, match="needs a token scope"):
        keep_topk([s], 0.5, "head", reduction="rank")


@pytest.mark.parametrize("scope", ["head", "layer", "global", "token_layer"])
def test_a_sliding_layer_spends_its_budget_on_what_its_window_shows(scope) -> None:
    """Brute force: a sliding layer (window 9) competes with its last 8 positions only, at r x 8 entries."""
    g = torch.Generator().manual_seed(2)
    windows, heads, n, ratio = [None, 9, 30], 2, 24, 0.5
    scores = [torch.randn(heads, n, generator=g) for _ in windows]
    scores[1][:, :16] += 10  # out of the window: however high, never kept
    kept = keep_topk_visible(scores, ratio, scope, windows)
    visible = [s if w is None else s[:, max(0, n - (w - 1)) :] for s, w in zip(scores, windows, strict=True)]
    expected = keep_topk(visible, ratio, scope)
    for layer, (mine, theirs, w) in enumerate(zip(kept, expected, windows, strict=True)):
        offset = max(0, n - (w - 1)) if w else 0
        assert [k.tolist() for k in mine] == [(k + offset).tolist() for k in theirs], (scope, layer)
    assert all(int(k.min()) >= 16 for k in kept[1]) and sum(len(k) for k in kept[1]) > 0
    if scope == "head":
        assert [len(k) for k in kept[1]] == [4, 4] and [len(k) for k in kept[2]] == [12, 12]
    with pytest.raises(ValueError, match="use token_layer"):
        keep_topk_visible(scores, ratio, "token_model", windows)


@pytest.mark.parametrize(("keep", "n"), [(0.3, 40), (0.5, 57), (0.1, 33), (0.75, 16)])
def test_adakv_scope_keeps_what_kvpress_adakv_press_keeps(keep, n) -> None:
    """Item by item against kvpress's AdaKVPress on the same scores (its safeguard, budget and rounding)."""
    from dataclasses import dataclass, field
    from types import SimpleNamespace

    from kvpress import AdaKVPress, ScorerPress

    @dataclass
    class Fixed(ScorerPress):
        table: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            return self.table[None].clone()

    g = torch.Generator().manual_seed(n)
    scores = [torch.randn(4, n, generator=g) * (1 + h) for h in range(3)]  # heads of uneven spread
    ours = keep_topk(scores, keep, "adakv")
    for layer, s in enumerate(scores):
        module = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"), layer_idx=layer)
        press = AdaKVPress(Fixed(compression_ratio=round(1 - keep, 10), table=s))
        press.compress(module, None, torch.zeros(1, 4, n, 2), None, None, {})
        _, heads, positions = module.masked_key_indices
        pruned = {(int(h), int(p)) for h, p in zip(heads, positions, strict=True)}
        kept = {(h, int(p)) for h, k in enumerate(ours[layer]) for p in k}
        assert kept == {(h, p) for h in range(4) for p in range(n)} - pruned, (keep, n, layer)
        assert min(len(k) for k in ours[layer]) >= 1 and len({len(k) for k in ours[layer]}) > 1  # uneven heads


def test_kvzip_with_a_token_scope_holds_the_same_positions_in_every_head(session, prompt) -> None:
    cache = KVzip(plus=True, keep_ratio=0.4, scope="token_layer", chunk_size=64).compress(session, prompt)
    for layer in cache.ragged:
        assert layer.head_positions(0).tolist() == layer.head_positions(1).tolist()
        assert set(range(prompt.head_len)) <= set(layer.head_positions(0).tolist())
        assert uniform_stride(layer.starts, layer.lengths) is not None  # decodes by the one-call uniform path
    assert torch.isfinite(next_logits_ragged(session, cache)).all()


def test_kvzip_oracle_method_keeps_the_head_and_the_budget(session, prompt) -> None:
    method = KVzip(plus=True, keep_ratio=0.4, scope="global", chunk_size=64)
    cache = method.compress(session, prompt)
    stats = cache.stats()
    assert stats["prune_ratio"] == pytest.approx(0.6, abs=0.01)
    for layer in cache.ragged:
        for h in range(2):
            assert set(range(prompt.head_len)) <= set(layer.head_positions(h).tolist())
    assert torch.isfinite(next_logits_ragged(session, cache)).all()


def test_cache_from_scores_threshold_and_window(session, prompt) -> None:
    dense = session.dense_prefill(prompt.context_ids)
    n = prompt.context_ids.shape[1]
    scores = [torch.arange(n, dtype=torch.float).expand(2, n) for _ in range(3)]
    cache = cache_from_scores(dense, scores, threshold=n - 20.0, window=5)
    assert cache.ragged[0].head_positions(1).tolist() == list(range(n - 20, n))
    cache = cache_from_scores(dense, [-s for s in scores], threshold=-9.0, window=5, sinks=2)
    assert cache.ragged[2].head_positions(0).tolist() == [*range(10), *range(n - 5, n)]


@pytest.mark.parametrize("scope", ["token_layer", "token_model"])
def test_kvzap_token_scopes_select_its_scores_by_the_reduction(session, prompt, tmp_path, scope) -> None:
    adapter = session.adapter
    surrogate = surrogate_run(tmp_path, adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads, "linear")
    budget = {"threshold": None, "keep_ratio": 0.3, "scope": scope, "reduction": "rank"}
    method = KVzap(surrogate=surrogate, window=8, sinks=2, **budget)
    cache = method.compress(session, prompt)
    _, scores = method.scores(session, prompt.context_ids)
    expected = keep_topk(protect_window(scores, 8, 2), 0.3, scope, reduction="rank")
    for layer, heads in zip(cache.ragged, expected, strict=True):
        assert [layer.head_positions(h).tolist() for h in range(len(heads))] == [k.tolist() for k in heads]
    by_max = keep_topk(protect_window(scores, 8, 2), 0.3, scope)
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(expected, by_max, strict=True))  # the reduction mattered


def test_kvzap_and_kvzip_with_pages_keep_whole_pages(session, prompt, tmp_path) -> None:
    adapter = session.adapter
    surrogate = surrogate_run(tmp_path, adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads, "linear")
    method = KVzap(surrogate=surrogate, threshold=None, keep_ratio=0.3, scope="token_model", page_size=8, window=8)
    cache = method.compress(session, prompt)
    _, scores = method.scores(session, prompt.context_ids)
    expected = keep_topk(protect_window(scores, 8, method.sinks), 0.3, "token_model", page_size=8)
    n = prompt.context_ids.shape[1]
    for layer, heads in zip(cache.ragged, expected, strict=True):
        kept = [layer.head_positions(h).tolist() for h in range(len(heads))]
        assert kept == [k.tolist() for k in heads]
        pages = {p // 8 for p in kept[0]}
        assert kept[0] == [p for p in range(n) if p // 8 in pages]  # whole pages only (the last may be short)
    zip_cache = KVzip(keep_ratio=0.4, scope="token_layer", page_size=8, chunk_size=64).compress(session, prompt)
    for layer in zip_cache.ragged:
        pages = {p // 8 for p in layer.head_positions(0).tolist()}
        assert layer.head_positions(1).tolist() == [p for p in range(n) if p // 8 in pages]
    with pytest.raises(KVResearchError, match="needs scope token_layer or token_model"):
        KVzap(surrogate=surrogate, threshold=None, keep_ratio=0.3, scope="head", page_size=16)
    with pytest.raises(KVResearchError, match="page_size must be a whole number"):
        KVzip(keep_ratio=0.3, scope="token_layer", page_size=0)
    for budget in ({"threshold": -4.0}, {"threshold": None, "keep_ratio": 0.3, "calibrate": True}):
        with pytest.raises(KVResearchError, match="decides per head"):  # the threshold rule would ignore the scope
            KVzap(surrogate=surrogate, scope="token_model", **budget)
    for options in ({"scope": "token_model"}, {"scope": "token_layer", "page_size": 16}, {"reduction": "rank"}):
        with pytest.raises(KVResearchError, match="decides per head"):
            KVzip(threshold=-3.0, **{"scope": "token_layer", **options})


def test_kvzap_fixed_budget_mode_keeps_the_window_and_the_ratio(session, prompt, tmp_path) -> None:
    adapter = session.adapter
    surrogate = surrogate_run(tmp_path, adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads, "linear")
    for scope in ("head", "layer", "global"):
        method = KVzap(surrogate=surrogate, threshold=None, keep_ratio=0.5, scope=scope, window=16)
        cache = method.compress(session, prompt)
        n = prompt.context_ids.shape[1]
        assert cache.stats()["prune_ratio"] == pytest.approx(0.5, abs=0.01)
        for layer in cache.ragged:
            for h in range(adapter.num_kv_heads):
                assert set(range(n - 16, n)) <= set(layer.head_positions(h).tolist())


def test_kvpress_own_kvzap_config_with_a_surrogate_run(session, prompt, tmp_path) -> None:
    adapter = session.adapter
    surrogate_run(tmp_path / "run", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads, "mlp")
    cfg = method_config(
        "kvpress_kvzap", ["press.threshold=0.0", "press.window=16"], paths={"surrogate_mlp": str(tmp_path / "run")}
    )
    cache = build(cfg).compress(session, prompt)
    n = prompt.context_ids.shape[1]
    assert 0.0 < cache.stats()["prune_ratio"] < 1.0
    assert all(set(range(n - 16, n)) <= set(layer.head_positions(0).tolist()) for layer in cache.ragged)
    assert torch.isfinite(next_logits_ragged(session, cache)).all()


@pytest.mark.slow
def test_kvpress_own_kvzip_press_on_the_embedded_model(smol) -> None:
    sess = Session(ModelAdapter(smol.model), smol.tokenizer)
    prompt = build_prompt(smol.tokenizer, "The capital of France is Paris. " * 20, "What is the capital of France?")
    cache = build(method_config("kvpress_kvzip", ["keep_ratio=0.5"])).compress(sess, prompt)
    assert cache.stats()["prune_ratio"] == pytest.approx(0.5, abs=0.02)
    assert cache.get_seq_length() == prompt.context_ids.shape[1]


def test_kvzap_keep_ratio_zero_still_keeps_the_window(session, prompt, tmp_path) -> None:
    adapter = session.adapter
    surrogate = surrogate_run(tmp_path, adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads)
    n = prompt.context_ids.shape[1]
    for scope in ("head", "layer", "global", "token_layer", "token_layer_global", "token_model"):
        cache = KVzap(surrogate=surrogate, threshold=None, keep_ratio=0.0, scope=scope, window=16).compress(
            session, prompt
        )
        for layer in cache.ragged:
            assert all(layer.head_positions(h).tolist() == list(range(n - 16, n)) for h in range(2))
    cache = KVzap(surrogate=surrogate, threshold=None, keep_ratio=0.0, window=16, sinks=3).compress(session, prompt)
    for layer in cache.ragged:
        assert all(layer.head_positions(h).tolist() == [0, 1, 2, *range(n - 16, n)] for h in range(2))
    with pytest.raises(KVResearchError, match="window and sinks must be >= 0"):
        KVzap(surrogate=surrogate, threshold=-4.0, sinks=-1)


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("snapkv", ["keep_ratio=1.5"], r"keep_ratio must lie in \[0, 1\]"),
        ("am_omp", ["keep_ratio=-0.1"], r"keep_ratio must lie in \[0, 1\]"),
        ("am_highest", ["keep_ratio=0.0"], r"keep_ratio must lie in \(0, 1\]"),
        ("kvzap_mlp", ["keep_ratio=0.5", "threshold=-4"], r"set method\.threshold=null"),
        ("kvzip_plus", ["keep_ratio=null"], r"exactly one of threshold and keep_ratio"),
        ("full", ["keep_ratio=0.5"], r"method=full keeps every entry"),
        ("kvpress_kvzap", ["keep_ratio=0.5"], r"takes no compression ratio"),
        ("kvzap_linear", ["scope=layers", "keep_ratio=0.3"], r"scope must be one of"),
        ("kvzap_mlp", ["keep_ratio=0.3", "reduction=rank"], r"needs a token scope"),
        ("kvzip_plus", ["scope=token_layer", "reduction=median"], r"reduction must be one of"),
    ],
)
def test_bad_method_options_fail_when_built_with_one_paragraph(name, overrides, message, tiny, tmp_path) -> None:
    adapter = ModelAdapter(tiny.model)
    for kind in ("mlp", "linear"):
        surrogate_run(tmp_path / kind, adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads, kind)
    paths = {"surrogate_mlp": str(tmp_path / "mlp"), "surrogate_linear": str(tmp_path / "linear")}
    with pytest.raises(KVResearchError, match=message):
        build(method_config(name, overrides, paths))


def test_kvzap_refuses_a_surrogate_run_of_another_kind_or_model(tiny, tmp_path) -> None:
    adapter = ModelAdapter(tiny.model)
    surrogate_run(tmp_path / "lin", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads, "linear")
    surrogate_run(tmp_path / "other", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads, "mlp", "qwen3_8b")
    with pytest.raises(KVResearchError, match="trained a linear surrogate, but this method needs mlp"):
        build(method_config("kvzap_mlp", paths={"surrogate_mlp": str(tmp_path / "lin")}))
    with pytest.raises(KVResearchError, match="trained for model 'qwen3_8b', not 'tiny_random'"):
        build(method_config("kvzap_mlp", paths={"surrogate_mlp": str(tmp_path / "other")}))
    with pytest.raises(KVResearchError, match="No train_surrogate run 'nowhere'"):
        build(method_config("kvzap_mlp", paths={"surrogate_mlp": "nowhere", "root": str(tmp_path)}))
