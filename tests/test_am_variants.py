"""Attention Matching beyond one uniform pass: on-policy, chunks, budgets, self-study, the KVzip-keys hybrid,
summarization."""

from __future__ import annotations

import copy
import itertools
import json

import pytest
import torch

from kvresearch.capture import chunked_oracle_scores
from kvresearch.data import head_budgets
from kvresearch.errors import KVResearchError
from kvresearch.methods.attention_matching import AttentionMatching
from kvresearch.methods.summarize import Summarize
from kvresearch.models import ModelAdapter, Session
from kvresearch.models.hooks import model_calls
from kvresearch.ops import budgets
from kvresearch.prompts import build_prompt
from kvresearch.runs import build, execute
from kvresearch.stages.budgets import run
from tests.helpers import compose_stage, method_config

TEXT = "The lighthouse keeper counted ships each night and wrote the numbers in a red book. " * 6
SHORT_STUDY = {"max_new_tokens": 6}


def entries(cache, layer: int, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions, biases and values a ragged cache holds for one head."""
    lay = cache.ragged[layer]
    rows = lay.head_rows(head)
    return lay.pos[rows], lay.bias[rows], lay.v[rows]


def same_cache(a, b, layers: range, heads: int) -> None:
    for i, h in itertools.product(layers, range(heads)):
        for x, y in zip(entries(a, i, h), entries(b, i, h), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def session(tiny) -> Session:
    return Session(ModelAdapter(tiny.model), tiny.tokenizer)


def test_on_policy_equals_off_policy_on_one_layer_and_only_from_layer_one_on_deeper_models(tiny, session) -> None:
    prompt = build_prompt(tiny.tokenizer, TEXT, "How many?")
    one = copy.deepcopy(tiny.model)  # the same model cut to its first layer
    one.model.layers = one.model.layers[:1]
    one.config.num_hidden_layers = 1
    if getattr(one.config, "layer_types", None):
        one.config.layer_types = one.config.layer_types[:1]
    single = Session(ModelAdapter(one), tiny.tokenizer)
    for keys in ("highest", "omp"):
        off = AttentionMatching(keep_ratio=0.3, keys={"select": keys}, queries={"sources": ["repeat"]}).compress(
            single, prompt
        )
        on = AttentionMatching(
            keep_ratio=0.3, keys={"select": keys}, queries={"sources": ["repeat"], "on_policy": True}
        ).compress(single, prompt)
        same_cache(off, on, range(1), 2)
    off = AttentionMatching(keep_ratio=0.3, queries={"sources": ["repeat"]}).compress(session, prompt)
    on = AttentionMatching(keep_ratio=0.3, queries={"sources": ["repeat"], "on_policy": True}).compress(session, prompt)
    same_cache(off, on, range(1), 2)  # layer 0's queries never depend on compaction
    differs = [not torch.equal(entries(off, 2, h)[2], entries(on, 2, h)[2]) for h in range(2)]
    assert any(differs)  # later layers see the compacted earlier ones


def test_one_chunk_is_the_unchunked_result_and_chunks_keep_their_share(tiny, session) -> None:
    prompt = build_prompt(tiny.tokenizer, TEXT, "How many?")
    article = prompt.article.stop - prompt.article.start
    whole = AttentionMatching(keep_ratio=0.25, queries={"sources": ["repeat", "context"]}).compress(session, prompt)
    one = AttentionMatching(
        keep_ratio=0.25, queries={"sources": ["repeat", "context"]}, budgets={"chunk_tokens": article}
    ).compress(session, prompt)
    same_cache(whole, one, range(3), 2)
    cut = article // 2 + 3
    two = AttentionMatching(keep_ratio=0.25, queries={"sources": ["repeat"]}, budgets={"chunk_tokens": cut}).compress(
        session, prompt
    )
    outside = prompt.context_ids.shape[1] - article
    for i, h in itertools.product(range(3), range(2)):
        pos = entries(two, i, h)[0]
        first = (pos >= prompt.article.start) & (pos < prompt.article.start + cut)
        assert int(first.sum()) == int(0.25 * cut)  # each chunk compacted at the global ratio
        assert len(pos) == outside + int(0.25 * cut) + int(0.25 * (article - cut))


def test_budget_file_round_trips_and_uneven_sizes_land_in_the_cache_without_padding(tiny, session, tmp_path) -> None:
    prompt = build_prompt(tiny.tokenizer, TEXT, "How many?")
    heads = [(i, h) for i in range(3) for h in range(2)]
    raw = dict(zip([head_budgets.head_name(*k) for k in heads], [0.05, 0.25, 0.1, 0.3, 0.2, 0.1], strict=True))
    shares = head_budgets.parse_shares(raw)
    assert head_budgets.dump_shares(shares) == raw and abs(sum(shares.values()) - 1) < 1e-12
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps(raw))
    method = AttentionMatching(keep_ratio=0.2, queries={"sources": ["repeat"]}, budgets={"heads": str(path)})
    cache = method.compress(session, prompt)
    article = prompt.article.stop - prompt.article.start
    want = budgets.sizes_from_shares(shares, heads, 0.2, article)
    assert sorted(set(want.values())) != [want[heads[0]]]  # really uneven
    outside = prompt.context_ids.shape[1] - article
    for i in range(3):
        layer = cache.ragged[i]
        assert layer.lengths.tolist() == [outside + want[(i, h)] for h in range(2)]
        assert layer.caps.tolist() == layer.lengths.tolist() and layer.k.shape[0] == int(layer.lengths.sum())
    with pytest.raises(KVResearchError, match="sum to 1"):
        head_budgets.parse_shares({"L0H0": 0.5})
    with pytest.raises(KVResearchError, match="L<layer>H<kv_head>"):
        head_budgets.parse_shares({"layer0": 1.0})


def test_global_budgets_spend_the_uniform_total_by_one_threshold(tiny, session) -> None:
    prompt = build_prompt(tiny.tokenizer, TEXT, "How many?")
    article = prompt.article.stop - prompt.article.start
    outside = prompt.context_ids.shape[1] - article
    for mode in ("global_layer", "global_model"):
        cache = AttentionMatching(keep_ratio=0.25, queries={"sources": ["repeat"]}, budgets={"heads": mode}).compress(
            session, prompt
        )
        kept = [[n - outside for n in layer] for layer in cache.stats()["kept_per_layer_head"]]
        if mode == "global_layer":
            assert all(abs(sum(layer) - int(0.25 * article * 2)) <= 2 for layer in kept)
        else:
            assert abs(sum(map(sum, kept)) - int(0.25 * article * 6)) <= 6
    scores = {(0, 0): torch.tensor([5.0, 4, 3, 2]), (0, 1): torch.tensor([9.0, 1, 0.5, 0.1])}
    assert budgets.sizes_from_scores(scores, 0.5) == {(0, 0): 3, (0, 1): 1}


def test_greedy_exchange_reaches_the_best_allocation_of_convex_loss_curves() -> None:
    levels = [0.05, 0.1, 0.15, 0.2, 0.25]
    weight = {("a", 0): 1.0, ("b", 0): 4.0, ("c", 0): 0.5}

    def loss(head, ratio):
        return weight[head] / ratio

    got = budgets.greedy_exchange(loss, list(weight), levels, 0.15)
    assert abs(sum(got.values()) - 0.45) < 1e-12
    best = min(
        (combo for combo in itertools.product(levels, repeat=3) if abs(sum(combo) - 0.45) < 1e-9),
        key=lambda c: sum(loss(h, r) for h, r in zip(weight, c, strict=True)),
    )
    assert tuple(got[h] for h in weight) == best
    with pytest.raises(KVResearchError, match="evenly spaced"):
        budgets.greedy_exchange(loss, list(weight), [0.05, 0.1, 0.3], 0.1)


def test_self_study_reuses_the_context_cache_and_is_seeded(tiny, session) -> None:
    prompt = build_prompt(tiny.tokenizer, TEXT, "How many?")
    n = prompt.context_ids.shape[1]
    lengths: list[int] = []
    with model_calls(session.model, lambda ids: lengths.append(ids.shape[1]), lambda ids: None):
        method = AttentionMatching(keep_ratio=0.3, queries={"sources": ["self_study"], "self_study": SHORT_STUDY})
        first = method.compress(session, prompt)
    assert sum(1 for x in lengths if x >= n) == 1  # the context is prefilled once: generation reuses its cache
    second = AttentionMatching(keep_ratio=0.3, queries={"sources": ["self_study"], "self_study": SHORT_STUDY}).compress(
        session, prompt
    )
    same_cache(first, second, range(3), 2)
    other = AttentionMatching(keep_ratio=0.3, queries={"sources": ["self_study"], "self_study": SHORT_STUDY, "seed": 1})
    assert not all(
        torch.equal(entries(first, 1, h)[2], entries(other.compress(session, prompt), 1, h)[2]) for h in range(2)
    )


def test_kvzip_keys_hybrid_keeps_the_oracle_top_keys_with_fitted_beta(tiny, session) -> None:
    prompt = build_prompt(tiny.tokenizer, TEXT, "How many?")
    method = AttentionMatching(keep_ratio=0.25, keys={"select": "kvzip"}, queries={"sources": ["repeat"]})
    cache = method.compress(session, prompt)
    prefill = session.dense_prefill(prompt.context_ids)
    context = prompt.context_ids[0, prompt.head_len :].tolist()
    scores = chunked_oracle_scores(session.adapter, tiny.tokenizer, prefill.cache, context, prompt.head_len)
    article = prompt.article.stop - prompt.article.start
    for i, h in itertools.product(range(3), range(2)):
        pos = entries(cache, i, h)[0]
        top = scores[i].kvzip_plus[h].topk(int(0.25 * article)).indices + prompt.head_len
        assert sorted(pos[pos >= prompt.head_len].tolist()) == sorted(top.tolist())
    assert any(bool((entries(cache, i, 0)[1] != 0).any()) for i in range(3))


def test_summarization_replaces_the_context_and_reports_the_true_ratio(tiny, session) -> None:
    prompt = build_prompt(tiny.tokenizer, TEXT, "How many?")
    method = Summarize(keep_ratio=0.1)
    cache = method.compress(session, prompt)
    report = method.report()
    n, article = prompt.context_ids.shape[1], prompt.article.stop - prompt.article.start
    assert 1 <= report["summary_tokens"] <= int(0.1 * article) and report["context_tokens"] == article
    assert cache.get_seq_length() == n - article + report["summary_tokens"]
    stats = cache.stats()
    assert stats["prune_ratio"] == pytest.approx(1 - (n - article + report["summary_tokens"]) / n)
    chained = build(method_config("summarize_am"))
    assert chained.then is not None and chained.then.keys.select == "highest"
    chained.compress(session, prompt)
    assert chained.report()["then"]["timings_s"]["values_s"] >= 0


@pytest.mark.parametrize(
    ("name", "queries", "on_policy", "keys"),
    [
        ("am_highest", ["repeat", "self_study"], False, "highest"),
        ("am_omp_fast_onpolicy", ["repeat", "self_study"], True, "omp"),
        ("am_kvzip_keys", ["repeat", "self_study"], False, "kvzip"),
    ],
)
def test_configs_build_the_query_mix_and_policy(name, queries, on_policy, keys) -> None:
    method = build(method_config(name))
    assert method.queries.sources == queries and method.queries.on_policy == on_policy and method.keys.select == keys


def test_budgets_stage_writes_a_file_that_compaction_loads(tmp_path, tiny, session) -> None:
    """The stage on the tiny model: shares sum to 1, the measured losses are recorded, AM takes the file."""
    overrides = ["model=tiny_random", "benchmark.max_prompt_tokens=700", "budgets.contexts=1", "budgets.questions=1"]
    metrics = execute(
        compose_stage("budgets", None, [*overrides, "budgets.new_tokens=8", f"paths.root={tmp_path}"]), run
    )
    folder = tmp_path / "budgets" / metrics["run"]["name"]
    shares = head_budgets.load_shares(folder / "budgets.json")
    assert set(shares) == {(i, h) for i in range(3) for h in range(2)}
    losses = json.loads((folder / "sensitivities.json").read_text())
    assert len(losses) == 6 * 4 and all(v == 0 for k, v in losses.items() if k.endswith("@0.1"))
    assert abs(sum(metrics["ratios"].values()) - 0.6) < 1e-9  # the start ratio's total, redistributed
    prompt = build_prompt(tiny.tokenizer, TEXT, "How many?")
    AttentionMatching(keep_ratio=0.2, budgets={"heads": str(folder / "budgets.json")}).compress(session, prompt)
    # The hand-off: am_*_budgets read the run of the step head_budgets:<model name>, which is this run.
    method = build(method_config("am_omp_budgets", paths={"root": str(tmp_path)}))
    assert method.shares == shares and method.inputs() == (str(folder.resolve()),)
    method.compress(session, prompt)
    with pytest.raises(KVResearchError, match="make experiment-head_budgets"):
        build(method_config("am_omp_budgets", paths={"root": str(tmp_path / "elsewhere")}))


def test_sliding_layers_are_compacted_on_what_their_window_shows() -> None:
    """Tiny Gemma-3 (window 8; layers sliding, sliding, global), 40 context ids, the article 2..37: the global
    layer compacts the article, each sliding layer the article's part among the last 7 positions (33..37)."""
    from kvresearch.prompts import Prompt
    from tests.helpers import tiny_family

    session = Session(ModelAdapter(tiny_family("gemma3")), None)
    ids = torch.randint(1, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    prompt = Prompt(ids, torch.tensor([[5, 6, 7]]), head_len=2, end_len=2)
    cache = AttentionMatching(keep_ratio=0.25, queries={"sources": ["context"]}).compress(session, prompt)
    for h in range(2):
        sliding = entries(cache, 0, h)[0]
        assert int(((sliding >= 33) & (sliding < 38)).sum()) == 1  # int(0.25 x 5) of the visible block
        assert {38, 39} <= set(sliding.tolist())  # the template's end, as it is
        glob = entries(cache, 2, h)[0]
        assert int(((glob >= 2) & (glob < 38)).sum()) == 9 and len(glob) == 13  # int(0.25 x 36), plus 4 outside
    stats = cache.stats()
    assert stats["prune_ratio_per_layer"] == [pytest.approx(4 / 7)] * 2 + [pytest.approx(27 / 40)]
    answer = session.generate(cache, prompt.question_ids, 3, eos=False)
    assert len(answer.tokens) == 3
