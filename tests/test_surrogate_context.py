"""Context-aware surrogates (``surrogate.context``): the columns training computes from an extract are the ones KVzap
computes at inference, each checked against a direct computation; the stage trains one; kvpress refuses it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvresearch.errors import KVResearchError
from kvresearch.methods.kvzap import KVzap
from kvresearch.models import ModelAdapter, Session
from kvresearch.prompts import Prompt
from kvresearch.runs import execute
from kvresearch.stages.extract import run as extract_stage
from kvresearch.stages.train_surrogate import run as train_stage
from kvresearch.surrogate.context import CONTEXT_INPUTS, count_rates, raw_counts
from kvresearch.surrogate.data import ExtractRun
from kvresearch.surrogate.export import to_kvpress
from kvresearch.surrogate.modules import Surrogate, SurrogateConfig, from_run
from tests.helpers import compose_stage


def brute_counts(ids: list[int]) -> np.ndarray:
    """(n, 5) float64 by loops: token, previous token, bigram, token before, bigram before."""
    bigrams = [(ids[q - 1], ids[q]) for q in range(1, len(ids))]
    out = np.zeros((len(ids), 5))
    for p, t in enumerate(ids):
        out[p, 0], out[p, 3] = ids.count(t), ids[:p].count(t)
        if p:
            out[p, 1] = ids.count(ids[p - 1])
            out[p, 2] = bigrams.count((ids[p - 1], t))
            out[p, 4] = bigrams[: p - 1].count((ids[p - 1], t))
    return out


def direct_columns(adapter: ModelAdapter, layer: int, h: torch.Tensor, ids: list[int], offset: int = 0) -> torch.Tensor:
    """(T, q_heads + 7) in float64: log ||v W_O^g|| by explicit products, log(1 + position), count rates, and
    log(1 + length) of the context ``ids``; ``h`` holds the rows of positions ``offset``, ``offset + 1``, ..."""
    _, _, v = adapter.project(layer, h.float()[None])
    w_o = adapter.output_weight(layer).double()  # (Hq, d, D)
    group = adapter.num_heads // adapter.num_kv_heads
    norms = torch.stack([(v[0, g // group].double() @ w_o[g]).norm(dim=-1) for g in range(adapter.num_heads)], 1)
    pos = torch.arange(offset, offset + len(h), dtype=torch.float64)[:, None]
    rates = torch.from_numpy(np.log1p(brute_counts(ids) * 1000 / len(ids)))[offset : offset + len(h)]
    length = torch.full((len(h), 1), float(len(ids)), dtype=torch.float64)
    log_norms = norms.clamp_min(1e-12).log()  # a zero norm: the floor training uses
    return torch.cat([log_norms, pos.log1p(), rates, length.log1p()], 1)


def test_count_rates_are_brute_force_counts_per_1000_tokens_and_free_of_the_length() -> None:
    ids = np.random.default_rng(0).integers(0, 6, 300)  # few distinct ids: every count is exercised many times
    np.testing.assert_array_equal(raw_counts(ids), brute_counts(ids.tolist()))
    np.testing.assert_allclose(count_rates(ids).numpy(), np.log1p(brute_counts(ids.tolist()) * 1000 / 300), rtol=1e-6)
    once, twice = count_rates(ids).numpy(), count_rates(np.r_[ids, ids]).numpy()  # the same text twice:
    np.testing.assert_allclose(twice[300:, 0], once[:, 0], rtol=1e-6)  # the token's whole-context rate stays
    np.testing.assert_allclose(twice[301:, 1], once[1:, 1], rtol=1e-6)  # and so does the previous token's
    assert count_rates(np.zeros(0, np.int64)).shape == (0, 5)
    with pytest.raises(KVResearchError, match=r"unknown input\(s\) \['count'\]; choose from"):
        SurrogateConfig("mlp", 2, 8, 1, context=("count",))


class Recording(Surrogate):
    """A surrogate that keeps what each layer was given."""

    seen: dict[int, list[torch.Tensor]]

    def forward_layer(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        self.seen.setdefault(layer, []).append(h.detach().clone())
        return super().forward_layer(layer, h)


def context_surrogate(adapter: ModelAdapter) -> Recording:
    torch.manual_seed(0)
    config = SurrogateConfig("mlp", adapter.num_layers, adapter.hidden_size, adapter.num_kv_heads, mlp_hidden=8,
                             mlp_layers=2, context=CONTEXT_INPUTS, q_heads=adapter.num_heads)  # fmt: skip
    surrogate = Recording(config).eval()
    surrogate.seen = {}
    return surrogate


def test_kvzap_gives_its_surrogate_h_and_the_directly_computed_columns_in_prefill_and_decoding(tiny) -> None:
    adapter = ModelAdapter(tiny.model)
    session = Session(adapter, tiny.tokenizer)
    ids = torch.randint(0, 40, (1, 90), generator=torch.Generator().manual_seed(1))  # repeats: counts above 1
    question = torch.tensor([[5, 6, 7]])
    prompt = Prompt(context_ids=ids, question_ids=question)
    surrogate = context_surrogate(adapter)
    width = adapter.hidden_size + adapter.num_heads + 7
    for method in (KVzap(surrogate=surrogate, threshold=0.0, window=8, decoding=True),
                   KVzap(surrogate=surrogate, threshold=None, keep_ratio=0.5, window=8)):  # fmt: skip
        surrogate.seen = {}
        cache = method.compress(session, prompt)
        for layer in range(adapter.num_layers):
            (x,) = surrogate.seen[layer]  # one call: the whole context
            assert x.shape == (90, width)
            want = direct_columns(adapter, layer, x[:, : adapter.hidden_size], ids[0].tolist())
            torch.testing.assert_close(x[:, adapter.hidden_size :].double(), want, rtol=1e-4, atol=1e-4)
    # decoding, on the cache of the threshold rule
    method = KVzap(surrogate=surrogate, threshold=0.0, window=8, decoding=True)
    cache = method.compress(session, prompt)
    surrogate.seen = {}
    decode = lambda c: method.decode_context(session, c)
    tokens = session.generate(cache, question, 4, decode_context=decode, in_place=True).tokens
    fed = torch.cat(cache.method_state["kvzap_ids"]).tolist()  # every id the model was given, in order
    assert fed == ids[0].tolist() + question[0].tolist() + tokens[: len(fed) - 93]
    last = surrogate.seen[0][-1]  # the last decoding step: one token, counted over everything fed so far
    assert last.shape == (1, width)
    want = direct_columns(adapter, 0, last[:, : adapter.hidden_size], fed, offset=len(fed) - 1)
    torch.testing.assert_close(last[:, adapter.hidden_size :].double(), want, rtol=1e-4, atol=1e-4)


def test_the_stage_trains_a_context_surrogate_on_a_real_extract_with_the_same_columns(tmp_path, tiny) -> None:
    overrides = ["model=tiny_random", "corpus.min_tokens=60", "corpus.max_tokens=120", "corpus.n_train_per_source=2",
                 "corpus.n_test_per_source=1", "extract.samples_per_doc=40"]  # fmt: skip
    execute(compose_stage("extract", tmp_path / "extract", overrides), extract_stage)
    train = [
        "surrogate=mlp_context",
        "surrogate.epochs=2",
        "surrogate.mlp_hidden=8",
        f"paths.extract={tmp_path / 'extract'}",
    ]
    metrics = execute(compose_stage("train_surrogate", tmp_path / "train", train), train_stage)
    assert np.isfinite(metrics["test"]["r2_mean"])  # the run scored its test documents
    surrogate = from_run(str(tmp_path / "train"), "mlp")  # what kvzap_mlp_context loads
    adapter = ModelAdapter(tiny.model)
    assert surrogate.config.context == CONTEXT_INPUTS and surrogate.config.q_heads == adapter.num_heads
    assert surrogate.weights[0].shape[1] == adapter.hidden_size + adapter.num_heads + 7
    assert not (tmp_path / "train" / "kvpress").exists()
    with pytest.raises(KVResearchError, match=r"reads \['value_norms', 'position', 'counts', 'length'\]"):
        to_kvpress(surrogate, tmp_path / "kvpress")

    # the training rows carry, after h, the columns KVzap computes: for one document, against the direct ones
    data = ExtractRun(tmp_path / "extract")
    data.add_context(CONTEXT_INPUTS, adapter, tiny.tokenizer)
    doc = data.manifest["documents"][1]
    rows = data.rows_of({doc["index"]})
    x, _ = data.fetch(rows)
    pos = np.concatenate([np.asarray(s.pos) for s in data.shards])[rows]
    ids = data.document_ids(tiny.tokenizer)[doc["index"]].tolist()
    assert len(ids) == doc["n_tokens"]
    for layer in range(adapter.num_layers):
        h = x[:, layer, : adapter.hidden_size]
        full = torch.stack([direct_columns(adapter, layer, h[i : i + 1], ids, int(p))[0] for i, p in enumerate(pos)])
        torch.testing.assert_close(x[:, layer, adapter.hidden_size :].double(), full, rtol=1e-4, atol=1e-4)
