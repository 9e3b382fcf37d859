"""Attention Matching compaction in a real model: the cache holds what the solver predicted."""

from __future__ import annotations

import pytest
import torch

from kvresearch.errors import KVResearchError
from kvresearch.methods.attention_matching import AttentionMatching
from kvresearch.models import ModelAdapter, Session
from kvresearch.models.hooks import attention_inputs
from kvresearch.models.ragged_attention import ragged_attention_enabled
from kvresearch.ops import am
from kvresearch.prompts import build_prompt
from kvresearch.runs import build
from tests.helpers import method_config


@pytest.mark.parametrize("keys", ["highest", "omp"])
def test_compacted_cache_reproduces_the_solver_in_a_forward_pass(tiny, keys) -> None:
    session = Session(ModelAdapter(tiny.model), tiny.tokenizer)
    prompt = build_prompt(tiny.tokenizer, "Rivers carry water to the sea, and the sea returns it as rain. " * 8, "Why?")
    method = AttentionMatching(keep_ratio=0.25, keys={"select": keys}, queries={"sources": ["repeat", "context"]})
    cache = method.compress(session, prompt)
    n = prompt.context_ids.shape[1]
    assert cache.get_seq_length() == n
    article = prompt.article.stop - prompt.article.start
    kept = n - article + int(0.25 * article)  # template tokens kept as they are, the article at the floor budget
    assert cache.stats()["kept_per_layer_head"] == [[kept, kept]] * 3
    assert {"queries_s", "keys_s", "beta_s", "values_s"} <= set(method.timings)
    report = method.report()
    assert 0 <= report["heldout_output_rel_l2"] < 1 and len(report["per_layer_head"]) == 3 * 2

    # One new token through the compacted cache; layer 0's attention output must equal the formula
    # softmax([q C_k^T s + beta ; q k_new s]) [C_v ; v_new], built here from the cache's own entries.
    adapter = session.adapter
    layer = cache.ragged[0]
    ck = [layer.k[layer.head_rows(h)].double() for h in range(2)]
    cv = [layer.v[layer.head_rows(h)].double() for h in range(2)]
    beta = [layer.bias[layer.head_rows(h)].double() for h in range(2)]
    outputs, inputs = {}, {}
    hook = adapter.layers[0].attn.register_forward_hook(lambda m, a, out: outputs.__setitem__(0, out[0]))
    try:
        with ragged_attention_enabled(tiny.model), torch.no_grad(), attention_inputs(adapter, inputs):
            tiny.model(input_ids=torch.tensor([[42]]), past_key_values=cache, use_cache=True)
    finally:
        hook.remove()
    q, k_new, v_new = adapter.qkv(0, inputs[0], torch.tensor([[n]]))
    heads = []
    s = adapter.layers[0].scaling
    for g in range(adapter.num_heads):
        h, qg = g // adapter.group_size, q[0, g, 0].double()
        logits = torch.cat([ck[h] @ qg * s + beta[h], (k_new[0, h, 0].double() @ qg * s)[None]])
        heads.append(torch.softmax(logits, 0) @ torch.cat([cv[h], v_new[0, h].double()]))
    expected = adapter.layers[0].attn.o_proj(torch.cat(heads).float()[None])
    torch.testing.assert_close(outputs[0][0, 0], expected[0], rtol=1e-4, atol=1e-5)
    assert bool((beta[0] != 0).any())  # biases were written


def test_ablations_and_bad_arguments(tiny) -> None:
    session = Session(ModelAdapter(tiny.model), tiny.tokenizer)
    prompt = build_prompt(tiny.tokenizer, "A short context about maps. " * 10, "What?")
    cache = AttentionMatching(
        keep_ratio=0.5, fit={"beta": False, "values": False}, queries={"sources": ["random"]}
    ).compress(session, prompt)
    layer = cache.ragged[1]
    assert bool((layer.bias[layer.head_rows(0)] == 0).all())
    with pytest.raises(KVResearchError, match="keep_ratio"):
        AttentionMatching(keep_ratio=0.0)
    with pytest.raises(KVResearchError, match=r"queries\.sources: unknown"):
        AttentionMatching(keep_ratio=0.1, queries={"sources": ["summaries"]})
    with pytest.raises(KVResearchError, match="on_policy"):
        AttentionMatching(keep_ratio=0.1, queries={"sources": ["context"], "on_policy": True})
    with pytest.raises(
        KVResearchError, match=r"method am: keys: unknown option\(s\) \['omp_drop_below'\]; known: \['select'"
    ):
        AttentionMatching(keep_ratio=0.1, keys={"omp_drop_below": -7})  # a flat name inside the group: named
    with pytest.raises(KVResearchError, match="fit must be a group of options"):
        AttentionMatching(keep_ratio=0.1, fit=False)


@pytest.mark.parametrize(
    ("name", "keys", "bounds", "fits"),
    [
        ("am_highest_fast", "highest", am.HIGHEST_BOUNDS, True),
        ("am_highest", "highest", am.HIGHEST_BOUNDS, True),
        ("am_omp", "omp", am.OMP_BOUNDS, True),
        ("am_omp_fast", "omp", am.OMP_BOUNDS, True),
        ("top_attention", "highest", am.HIGHEST_BOUNDS, False),
    ],
)
def test_method_configs_build_the_papers_variants(name, keys, bounds, fits) -> None:
    method = build(method_config(name))
    assert method.name == name and method.keys.select == keys and method.bounds == bounds
    assert method.fit.beta == method.fit.values == fits and method.fit.work_dtype == "float32"
    if name == "am_omp_fast":
        assert method.keys.omp["keys_per_step"] == 4 and method.keys.omp["refit_every"] == 2
        assert method.keys.omp["drop_below"] == -7.0  # from am_omp, which it starts from
